"""The sandbox child's prologue: confines the process before any untrusted code runs.

This file is not imported by the parent: its source text is the first part of the program the
sandboxed interpreter runs (`python -I -B -c SOURCE SETTINGS_JSON`), so it uses the standard library
only and runs on any Python 3.8+. `confine(settings)` runs as the first process of the sandbox
(pid 1 of its pid namespace where there is one, root in its mount namespace where there is one)
and, in this order:

1. moves the result channel (if any) to descriptor 3 and closes every other one but 0, 1 and 2;
2. joins the pids cgroup `settings["cgroup"]` (before it can fork);
3. with `private_tmp`: mounts a fresh tmpfs on `/tmp`, `/var/tmp`, `/dev/shm` and `/run/lock` (the
   world-writable places), bind-mounts the working directory at its own path inside that tmpfs,
   remounts every other mount read-only (outside `/proc`, `/sys`, `/dev`) and enters the working
   directory through the bind mount, so `..` leads into the private tmpfs and not to the host;
4. sets the resource limits (CPU, address space, file size, open files, no core dumps, processes);
5. drops to `settings["uid"]` (groups, gid, uid); without one, a process that is root (in its user
   namespace) drops every capability instead, so it cannot raise its limits, undo the read-only
   mounts or signal other users' processes; then sets no_new_privs, so no setuid binary can give
   privileges back.

Any failure exits with status 97 before untrusted code could run. The parent appends the call
`CHANNEL_FD = confine(json.loads(sys.argv[1]))` and then the program to run.
"""

import json  # noqa: F401 -- the appended call uses it
import os
import resource
import sys

CONFINE_FAILED = 97
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND = 1, 2, 4, 8, 32, 4096
_PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAPBSET_DROP = 24
_CAPABILITY_VERSION_3 = 0x20080522


def _fail(step, error):
    sys.stderr.write("sandbox: could not %s: %s\n" % (step, error))
    sys.stderr.flush()
    os._exit(CONFINE_FAILED)


def _mount(libc, source, target, fstype, flags, data):
    import ctypes

    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        raise OSError(ctypes.get_errno(), "mount %s: %s" % (target, os.strerror(ctypes.get_errno())))


def _private_filesystem(workdir, tmpfs_mb):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/self/mountinfo") as f:
        mounts = [(line.split()[4], line.split()[5]) for line in f]
    private = [d for d in _PRIVATE_DIRS if os.path.isdir(d) and not os.path.islink(d)]
    for d in private:
        _mount(libc, "tmpfs", d, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=%dm,mode=1777" % tmpfs_mb)
    os.makedirs(workdir, exist_ok=True)  # the same path, now inside the private tmpfs
    _mount(libc, ".", workdir, None, _MS_BIND, None)  # "." is still the host's working directory
    keep = ("/proc", "/sys", "/dev")
    for target, options in mounts:
        if target in private or any(target == k or target.startswith(k + "/") for k in keep):
            continue
        # Flags a user namespace locks must be repeated, or the remount is refused.
        opts = options.split(",")
        flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY
        flags |= (_MS_NOSUID if "nosuid" in opts else 0) | (_MS_NODEV if "nodev" in opts else 0)
        flags |= _MS_NOEXEC if "noexec" in opts else 0
        try:
            _mount(libc, None, target, None, flags, None)
        except OSError:
            if target == "/":
                raise
    os.chdir(workdir)


def _join_cgroup(path):
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def _limits(limits):
    table = {"cpu": resource.RLIMIT_CPU, "as": resource.RLIMIT_AS, "fsize": resource.RLIMIT_FSIZE,
             "nofile": resource.RLIMIT_NOFILE, "core": resource.RLIMIT_CORE, "nproc": resource.RLIMIT_NPROC}
    for name, value in limits.items():
        if value is not None:
            resource.setrlimit(table[name], (value, value))


def _drop_privileges(uid):
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid or os.getegid() != uid:
        raise OSError("still uid %d" % os.geteuid())


def _drop_capabilities():
    """Empty the bounding set and the effective, permitted and inheritable sets (best effort: the
    parent's probe reports whether it worked)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        for cap in range(64):
            if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                break  # EINVAL past the last capability
        header = (ctypes.c_uint32 * 2)(_CAPABILITY_VERSION_3, 0)
        libc.capset(header, (ctypes.c_uint32 * 6)())
    except (ImportError, OSError, AttributeError):
        pass


def _no_new_privs():
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    except (ImportError, OSError, AttributeError):
        pass  # best effort: the uid drop is what matters


def _close_fds(channel):
    """Keep 0, 1, 2 and the channel as descriptor 3; close the rest. Returns the channel's descriptor."""
    if channel is not None and channel != 3:
        os.dup2(channel, 3)
        os.close(channel)
    last = 3 if channel is not None else 2
    os.closerange(last + 1, max(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 1024))
    return 3 if channel is not None else None


def confine(settings):
    """Apply `settings` (see the module docstring) to this process, or exit with `CONFINE_FAILED`.
    Returns the result channel's file descriptor (3), or None without one."""
    try:
        channel = _close_fds(settings.get("channel_fd"))
    except OSError as e:
        _fail("close inherited files", e)
    steps = (
        ("join the pids cgroup", settings.get("cgroup"), _join_cgroup),
        ("make the filesystem private", settings.get("private_tmp"),
         lambda _: _private_filesystem(settings["workdir"], settings["tmpfs_mb"])),
        ("set resource limits", settings.get("limits"), _limits),
        ("drop privileges", settings.get("uid"), _drop_privileges),
    )
    for step, value, apply in steps:
        if value is None or value is False:
            continue
        try:
            apply(value)
        except Exception as e:  # noqa: BLE001 -- any failure must stop untrusted code from running
            _fail(step, e)
    if os.geteuid() == 0:
        _drop_capabilities()
    _no_new_privs()
    return channel
