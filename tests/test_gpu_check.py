"""tools/gpu_check.py's --small CPU mode runs in the suite, so the device script cannot rot between GPU loans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "tools", "gpu_check.py")


@pytest.mark.timeout(120)
def test_gpu_check_small_mode_writes_every_section_and_fingerprints_agree(tmp_path):
    out = tmp_path / "small.json"
    done = subprocess.run([sys.executable, SCRIPT, "--small", "--out", str(out)], capture_output=True, text=True,
                          timeout=110, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    r = json.loads(out.read_text()) if out.exists() else {}
    assert done.returncode == 0 and not r.get("errors"), (r.get("errors"), done.stderr[-3000:])
    assert r["small"] and r["device"] == "cpu"
    assert r["equality"]["ok"] and r["equality"]["cases"] == 12 * 6 * 3 and not r["equality"]["mismatches"]
    assert [f["bit"] for f in r["equality"]["bit_flips"]] == [0, 7, 22, 23, 30, 31]
    assert r["consensus"]["aten_ops_not_views"] <= 100
    for key in ("fingerprint_gb_s", "sum_gb_s", "copy_gb_s", "many_fingerprint_gb_s"):
        assert r["throughput"][key] > 0
    assert r["step"]["plain_s"] > 0 and r["step"]["guarded_s"] > 0
    # The oracle witnessed its own slices every step after the first, and a clean run has no mismatch.
    [own] = r["owner"]
    assert own["plain_s"] > 0 and own["oracle_steps_checked"] == 5 and own["oracle_mismatches"] == 0
    # HF GPT-2 (dropout inside the fused attention) and Llama: clean, and the weights the plain loop's, bit for bit.
    for row in r["hf"]:
        assert row["incident"] is None and row["weights_equal_plain"] and row["abft_passed"] == 5, row
        assert [n.split(" in ")[0] for n in row["products"]] == ["fused attention 0", "fused attention 1", "fused "
                                                                   "attention 2", "fused attention 3"], row
    for key in ("torch_save_s", "verified_save_s", "dcp_save_s", "async_blocking_s", "torch_load_s",
                "verified_restore_s", "dcp_load_s"):
        assert r["io"][key] > 0
    # guard_cost on tiny widths: each measured against plain steps, counted and predicted by the cost model, the
    # guard's own estimate beside it, and row_stats timed against torch.sum where the module imports.
    widths = r["guard_cost"]["widths"]
    assert [w["d"] for w in widths] == [32, 64] and all("error" not in w for w in widths), widths
    for w in widths:
        assert w["plain_s"] > 0 and w["abft_passed"] == 4 and w["guard_expected_overhead"] is not None, w
        assert {"overhead", "overhead_no_forward", "overhead_no_abft"} <= w.keys()
        assert w["predicted"]["guarded"]["ops"] > w["predicted"]["plain"]["ops"] > 0
        assert w["predicted"]["predicted_overhead"] > 0 and {"at_measured_sum_bandwidth", "on_h200"} <= w["predicted"].keys()
        assert w["kernel"]["step"]["sum_gb_s"] > 0, w["kernel"]
        if "skipped" not in w["kernel"]:
            assert w["kernel"]["step"]["row_stats_gb_s"] > 0, w["kernel"]
            assert w["kernel"]["step"]["max_rel_diff_vs_torch"] < 1e-5, w["kernel"]
        # The weights' one-read kernel beside the torch path's three passes (CUDA only: here the torch path alone)
        assert w["kernel"]["weights"]["torch_gb_s"] > 0 and "not run" in w["kernel"]["weights"]["weight_stats"], w
        # And an eager attention's product check beside its torch path (the kernel on CUDA only)
        assert w["kernel"]["products"]["torch_gb_s"] > 0 and "not run" in w["kernel"]["products"]["product_stats"], w
    assert set(r["seconds"]) == {"equality", "guard_cost", "throughput", "consensus", "step", "owner", "hf", "io"}


@pytest.mark.timeout(30)
def test_a_section_past_its_cap_is_stopped_and_an_outer_alarm_survives():
    saved = list(sys.path)
    try:
        import gpu_check  # tools/ is on the suite's path; the script puts tools/bench and examples before it
    finally:
        sys.path[:] = saved

    def forever() -> None:
        while True:  # a section whose loop never ends: only the cap stops it
            pass

    outer = signal.getitimer(signal.ITIMER_REAL)[0]  # pytest-timeout's alarm, where it times by signal
    with pytest.raises(gpu_check.SectionCap, match="section spin ran past its cap"):
        gpu_check.capped("spin", 0.2, forever)
    assert gpu_check.capped("quick", 5.0, lambda: 7) == 7  # and the timer is off once a section returns
    assert (signal.getitimer(signal.ITIMER_REAL)[0] > 0) == (outer > 0)  # an outer alarm is set again, not cancelled
