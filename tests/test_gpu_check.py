"""tools/gpu_check.py's --small CPU mode runs in the suite, so the device script cannot rot between GPU loans."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "tools", "gpu_check.py")


@pytest.mark.timeout(120)
def test_gpu_check_small_mode_writes_every_section_and_fingerprints_agree(tmp_path):
    out = tmp_path / "small.json"
    done = subprocess.run([sys.executable, SCRIPT, "--small", "--out", str(out)], capture_output=True, text=True,
                          timeout=110, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
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
