"""Hardware presets: slice names count chips as Cloud TPU does, datasheet numbers reach the plan,
and the measured `cpu` preset (`cpu_hardware`) reads its calibration file (shared by the process's devices)."""

import json

import jax
import pytest

from tpurl import hostmem
from tpurl.plan.calibrate import cpu_hardware
from tpurl.plan.hardware import CHIPS, hardware


@pytest.mark.parametrize("name,chip,devices", [("tpu-v5p-8", "v5p", 4), ("tpu-v4-32", "v4", 16),
                                               ("tpu-v5e-8", "v5e", 8), ("tpu-v6e-16", "v6e", 16),
                                               ("h100x8", "h100", 8), ("B200x4", "b200", 4)])
def test_preset_names(name, chip, devices):
    hw = hardware(name)
    assert hw.chip is CHIPS[chip] and hw.devices == devices


@pytest.mark.parametrize("name", ["tpu-v5p-3", "h100x0", "v100x8", "tpu-v5p"])
def test_bad_names_are_one_line_errors(name):
    with pytest.raises(ValueError) as e:
        hardware(name)
    assert len(str(e.value).splitlines()) == 1 and name in str(e.value)


def test_looking_up_a_preset_measures_nothing(monkeypatch):
    """The presets are data: `hardware("cpu")` is a one-line error pointing at the measuring step,
    and never starts a measurement."""
    import tpurl.plan.calibrate as calibrate

    monkeypatch.setattr(calibrate, "measure_cpu", lambda: pytest.fail("a lookup measured the machine"))
    with pytest.raises(ValueError, match="cpu_hardware") as e:
        hardware("cpu")
    assert len(str(e.value).splitlines()) == 1


CAL = {"matmul_flops": 8e10, "efficiency": 0.25, "forward_efficiency": 0.5, "memory_bandwidth": 1.6e10, "launch_s": 1e-5,
       "decode_slot_s": 2e-5, "sequence_s": 3e-5, "sync_host_s": 4e-4, "host_malloc": hostmem.applied_mode()}


def test_cpu_preset_reads_its_calibration(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(CAL))
    hw = cpu_hardware(str(path))
    n = jax.device_count()
    assert hw.devices == n
    assert hw.chip.peak_flops == 8e10 / n and hw.chip.hbm_bandwidth == 1.6e10 / n
    assert (hw.chip.efficiency, hw.chip.step_overhead_s, hw.chip.decode_slot_s) == (0.25, 1e-5, 2e-5)
    assert hw.chip.forward_rate == 8e10 / n * 0.5 and hw.chip.sequence_s == 3e-5 and hw.chip.sync_host_s == 4e-4
    path.write_text(json.dumps({**CAL, "launch_s": "fast"}))
    with pytest.raises(ValueError, match="delete it"):
        cpu_hardware(str(path))


def test_a_calibration_missing_a_field_is_measured_again(tmp_path, monkeypatch):
    """A cache written by an older tpurl (without `sync_host_s`) is replaced by a new measurement."""
    import tpurl.plan.calibrate as calibrate

    monkeypatch.setattr(calibrate, "measure_cpu", lambda: {**CAL, "matmul_flops": 9e10})
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({k: v for k, v in CAL.items() if k != "sync_host_s"}))
    assert cpu_hardware(str(path)).chip.peak_flops == 9e10 / jax.device_count()
    assert json.loads(path.read_text())["matmul_flops"] == 9e10


def test_a_calibration_of_another_host_allocator_is_refused(tmp_path):
    """Rates measured with the other allocator mode do not hold for this process: a one-line error
    naming the file and the fix, and the file is left as it was."""
    path = tmp_path / "cal.json"
    other = {"keep": "system", "system": "keep"}[hostmem.applied_mode()]
    path.write_text(json.dumps({**CAL, "host_malloc": other}))
    with pytest.raises(ValueError, match=f"measured with host_malloc='{other}'.*delete it to measure again") as e:
        cpu_hardware(str(path))
    assert len(str(e.value).splitlines()) == 1 and json.loads(path.read_text())["host_malloc"] == other
