"""A sandbox for untrusted generated code, and grading whose verdict that code cannot forge.

Each execution (`run_python`) is a separate process in a fresh temporary directory with an empty
environment (a minimal PATH), under CPU-time, address-space, file-size and process-count limits,
with a wall-clock timeout that kills its whole process tree and with stdout/stderr capped. Network,
pid, uid and filesystem isolation use the strongest mechanism this machine allows, probed once and
reported by `sandbox_mechanisms()` (recorded in run manifests):

    network     "netns": a network namespace with no interface up (connecting anywhere, 127.0.0.1
                included, fails); "none"
    pid         "pidns": a pid namespace whose init is the sandboxed program, so every process it
                starts dies with it; "none": its process group (and the cgroup or uid below)
    uid         "61000+": root drops the code to an unused uid of its own (RLIMIT_NPROC binds,
                nothing of root's is writable or readable); "none"
    processes   "rlimit_nproc" (own uid), "cgroup_pids" (a pids cgroup), "rlimit_nproc_shared"
                (the caller's uid, counting its other processes), "none"
    filesystem  "read-only, private /tmp": everything read-only but the working directory, with a
                private tmpfs on /tmp, /var/tmp, /dev/shm, /run/lock; "uid permissions"; "none"

`SandboxPool` runs many executions at once, at most `SandboxConfig.workers`. `grade(solution,
tests)` runs a test file against a solution (see `grading` for the threat model and design).

Modules: `config` (SandboxConfig), `confine` (the child's prologue), `process` (one execution),
`runner` (probing and running), `plan` (test file -> checks), `harness` (the in-sandbox test
runner), `grading` (verdicts), `cli` (`tpurl grade-code`).
"""

from tpurl.sandbox.cases import Plan, PlanError, plan_tests
from tpurl.sandbox.config import SandboxConfig
from tpurl.sandbox.grading import CaseResult, Verdict, grade
from tpurl.sandbox.process import Execution, SandboxError
from tpurl.sandbox.runner import SandboxPool, run_python, sandbox_mechanisms

__all__ = ["CaseResult", "Execution", "Plan", "PlanError", "SandboxConfig", "SandboxError", "SandboxPool", "Verdict",
           "grade", "plan_tests", "run_python", "sandbox_mechanisms"]
