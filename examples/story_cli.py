"""What the Hugging Face and Lightning examples share: their common options, the test suite's ``--story DIR``
mode, and the library's exit-code table (as ``ddp_train.py``) when the guard stops the job on an incident."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any, NoReturn

import torch.distributed as dist

from verified_ckpt import SilentCorruptionDetected
from verified_ckpt.recovery import record_verdict


def parser(doc: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Under torchrun spell it --run-url: torchrun's parser takes a bare --run for its own --run-path (torch 2.13).
    ap.add_argument("--run", "--run-url", dest="run", help="run URL (checkpoints)")
    ap.add_argument("--inject", action="append", default=[], help="fault spec SITE:RANK:STEP[:MODE] (testing)")
    ap.add_argument("--resume", action="store_true", help="continue from the run (the rollback target after an incident)")
    ap.add_argument("--story", metavar="DIR", help="run the test suite's story into DIR")
    return ap


def run(ap: argparse.ArgumentParser, a: argparse.Namespace, story: Callable[[str], dict[str, Any]],
        train: Callable[[str], object]) -> NoReturn:
    """``--story DIR``: ``story(DIR)``, written to ``DIR/story.json`` by rank 0. Otherwise ``train(out)`` with a
    scratch output folder; exit 4 with the incident on stderr when the guard stops it. The process leaves
    through :func:`leave`, never through interpreter teardown."""
    if a.story:
        result = story(a.story)
        if int(os.environ.get("RANK", "0")) == 0:
            with open(os.path.join(a.story, "story.json"), "w") as f:
                json.dump(result, f)
        leave(0)
    if not a.run:
        ap.error("--run is required")
    code = 0
    with tempfile.TemporaryDirectory() as out:
        try:
            train(out)
        except SilentCorruptionDetected as e:
            print(f"incident: {e}", file=sys.stderr)
            code = int(record_verdict(e))  # the exit-code table; torchelastic's error file under torchrun
    leave(code)


def leave(code: int) -> NoReturn:
    """Exit with ``code`` once every rank is done, without interpreter teardown.

    Rarely (about 1 run in 40 here, and once in CI in the HF story) a gloo rank aborted in a C++ destructor at
    interpreter exit ("terminate called without an active exception"), after all its work was written, turning
    a finished run into SIGABRT: ``ddp_train.py`` leaves the same way. The barrier keeps a rank from tearing its
    group down while another still talks to it; a rank stopped by an incident skips it (the others may be gone).
    """
    if dist.is_initialized():
        if code == 0:
            dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
