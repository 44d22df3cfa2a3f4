"""``vckpt batch-record`` with a completion report whose CSV field is over csv's limit (128 KiB): one line naming the
file's problem, exit 2 (an input error), nothing recorded; never a traceback and exit 1, which automation reads as
"a check failed" (issue 48, Integrity 5)."""

from __future__ import annotations

import os

import pytest
import torch
from click.testing import CliRunner

from verified_ckpt import CheckpointManager
from verified_ckpt.checkpoint.batchops import parse_report
from verified_ckpt_cli.main import main

HUGE = b"x" * ((128 << 10) + 1)  # one byte over csv's default field_size_limit (131072)


def test_a_report_field_over_the_csv_limit_is_a_value_error_naming_the_line():
    report = b"Bucket,Key,VersionId,TaskStatus,ErrorCode,HTTPStatusCode,ResultMessage\nb,k,,succeeded,,200," + HUGE + b"\n"
    with pytest.raises(ValueError, match=r"not a CSV report: field larger than field limit .* at line 2"):
        parse_report([report])


def test_batch_record_with_a_field_over_the_csv_limit_is_one_line_and_exit_2(local_url, tmp_path):
    CheckpointManager(local_url).save(1, {"w": torch.ones(3)})
    report = tmp_path / "report.csv"
    report.write_bytes(b"b,k,,succeeded,,200,\"" + HUGE + b"\"\n")
    r = CliRunner().invoke(main, ["batch-record", local_url, str(report)])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception  # no traceback
    assert r.exit_code == 2, r.output
    assert r.stdout == ""
    assert r.stderr.count("\n") == 1 and "not a CSV report" in r.stderr and "field limit" in r.stderr, r.stderr
    assert not os.path.exists(os.path.join(local_url, "records", "verification"))  # nothing recorded
