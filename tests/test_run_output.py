"""What a run says about itself (issue 49, item 4): no warning from the project's own code on a supported set-up,
a mesh described as it is, and a coverage line that names what each layout leaves unchecked."""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from dist_harness import run_ranks

pytestmark = pytest.mark.timeout(240)


# Frames that only pass a warning on: the warnings machinery and deprecation wrappers (torch's c10d logger wraps
# its deprecated collectives, so a FutureWarning's filename is the wrapper's, never the caller's).
RELAYS = ("/warnings.py", "/typing_extensions.py", "/torch/distributed/c10d_logger.py", "/test_run_output.py")


def ours(stack: list) -> bool:
    """Whether the code that raised a warning, or called the deprecated function that did, is verified_ckpt's:
    the innermost frame that is not a relay. A warning that names the user's frame (``stacklevel``) is still
    raised by our code, so the raising frame counts, not the one the warning points at."""
    for frame in reversed(stack):
        path = frame.filename.replace("\\", "/")
        if not path.endswith(RELAYS):
            return "/verified_ckpt/" in path
    return False


@contextlib.contextmanager
def own_warnings() -> Iterator[list[str]]:
    """Collect every warning raised inside the block from verified_ckpt's own code (torch's are not ours)."""
    found: list[str] = []

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if ours(traceback.extract_stack()[:-1]):
            found.append(f"{filename}:{lineno}: {category.__name__}: {message}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        yield found


def fsdp_steps(rank: int, world: int, tp: bool) -> dict:
    """Three guarded steps at the default GuardConfig on pure FSDP2 (2 ranks) or FSDP2 + TP (2x2), recording every
    warning and the coverage line."""
    import logging

    from test_guard_fsdp import batch, build, loss_fn, tp_model
    from torch.distributed.device_mesh import init_device_mesh

    from verified_ckpt import GuardConfig, SDCGuard

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("verified_ckpt")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with own_warnings() as own:
            if tp:
                m = tp_model(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")), 0.0)
                x = [torch.randn(4, 8, generator=torch.Generator().manual_seed(s)) for s in range(3)]
            else:
                m, _ = build((world,))
                x = [batch(rank, s) for s in range(3)]
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
            guard = SDCGuard(m, opt, loss_fn, GuardConfig())
            for s in range(3):
                guard.backward(x[s], step=s)
                guard.step()
                opt.zero_grad()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return {"own": own, "log": lines, "incidents": len(guard.incidents)}


def test_fsdp2_and_fsdp2_tp_print_no_warning_of_ours_and_describe_their_mesh_and_unchecked_parts():
    """Issue 49, item 4: torch 2.13's FutureWarning for ``reduce_scatter_tensor`` (comm.py) on every FSDP step, and
    a UserWarning calling a 2x2 (dp_shard, tp) mesh "a 1-D (pure FSDP) data-parallel mesh"; the coverage line
    did not say that a TP Linear's input gradient is unchecked."""
    fsdp = run_ranks(fsdp_steps, 2, False, timeout=120)
    tp = run_ranks(fsdp_steps, 4, True, timeout=180, retire=True)
    for r in fsdp + tp:
        assert r["own"] == [] and r["incidents"] == 0, r
        assert not any("1-D" in line for line in r["log"]), r["log"]
    assert any("one replica group (2 shards)" in line for line in fsdp[0]["log"]), fsdp[0]["log"]
    assert any("one replica group (2 shards in each of 2 tensor-parallel columns)" in line for line in tp[0]["log"])
    coverage = next(line for line in tp[0]["log"] if line.startswith("SDCGuard: ABFT checks"))
    assert "unchecked: 0, 2: input gradient (a tensor-parallel slice" in coverage, coverage
    # Each slice's local GEMM output is checked (the rowwise one, 2, with its share of the bias): no incident above
    assert "forward output" not in coverage, coverage


def test_the_warning_filter_sees_a_deprecated_collective_called_from_verified_ckpt():
    """The filter above would let the old comm.py pass if it only read a warning's filename: torch's deprecation
    wrapper names its own file. A deprecated call from a verified_ckpt frame must count as ours."""
    from verified_ckpt import comm

    code = compile("import torch.distributed as dist\ndef call():\n    return dist.reduce_scatter_tensor(None, None)\n",
                   comm.__file__, "exec")
    space: dict[str, Any] = {}
    exec(code, space)
    with own_warnings() as own, contextlib.suppress(Exception):
        space["call"]()
    assert any("reduce_scatter_tensor` is deprecated" in w for w in own), own


def test_the_coverage_line_names_what_each_layout_leaves_unchecked_and_a_job_keeps_every_part_of_it():
    from verified_ckpt.guard.abft.layers import TP_UNCHECKED, Coverage

    tp = Coverage({"Linear": 2}, 0.9, 0.5, 0.7, [("0.bias", "why")], {}, [("0", TP_UNCHECKED), ("2", TP_UNCHECKED)])
    assert "; unchecked: 0, 2: input gradient (a tensor-parallel slice" in tp.summary()
    assert "unchecked" not in Coverage({"Linear": 1}, 1.0, 1.0, 1.0, [], {}).summary()
    job = Coverage.of_parts([(tp, 10), (Coverage({"Linear": 1}, 1.0, 1.0, 1.0, [], {}), 10)])
    assert job.unchecked == tp.unchecked


def test_one_replica_group_is_described_as_the_mesh_it_is():
    from verified_ckpt.guard.fsdp import one_replica_note
    from verified_ckpt.guard.sharded import MeshView

    two_by_two = MeshView.of([[0, 2], [1, 3], [0, 2], [1, 3]], [2])
    assert "one replica group (2 shards in each of 2 tensor-parallel columns)" in one_replica_note(two_by_two)
    assert "one replica group (4 shards):" in one_replica_note(MeshView.of([[0, 1, 2, 3]] * 4, [4]))
    assert "1-D" not in one_replica_note(two_by_two)
