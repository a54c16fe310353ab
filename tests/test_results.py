"""The result store's writes survive a crash (``harness.results.write_row``): a write that fails halfway,
by an exception inside the dump or by a kill of the writing process, over a row already there leaves that
row whole, and nothing a table reads besides it."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness import results
from harness.results import load_results, read_row, write_row

OLD = {"schema_version": results.SCHEMA_VERSION, "net": "vgg19", "strategy": "vanilla", "status": "ok",
       "measured_peak_bytes": 1}


def test_an_exception_inside_the_dump_leaves_the_old_row_and_no_temporary(tmp_path, monkeypatch):
    path = write_row(OLD, tmp_path, "cell.json")

    def half_then_fail(row, out, **kwargs):
        out.write(json.dumps(row)[:20])
        out.flush()
        raise RuntimeError("the disk went away")

    monkeypatch.setattr(results.json, "dump", half_then_fail)
    with pytest.raises(RuntimeError, match="the disk went away"):
        write_row({**OLD, "measured_peak_bytes": 2}, tmp_path, "cell.json")
    assert read_row(path) == OLD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cell.json"]


WRITER = """
import json, sys, time
from harness import results
def half_then_hang(row, out, **kwargs):
    out.write(json.dumps(row)[:20])
    out.flush()
    print("half", flush=True)
    time.sleep(60)
results.json.dump = half_then_hang
results.write_row({"schema_version": results.SCHEMA_VERSION, "net": "vgg19", "strategy": "vanilla",
                   "status": "ok", "measured_peak_bytes": 2}, sys.argv[1], "cell.json")
"""


def test_a_writer_killed_halfway_leaves_the_old_row_whole_and_tables_read_it_alone(tmp_path):
    path = write_row(OLD, tmp_path, "cell.json")
    root = Path(__file__).resolve().parent.parent
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    try:
        assert writer.stdout.readline().strip() == "half"  # the new row is half written now
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(timeout=30)
    finally:
        if writer.poll() is None:
            writer.kill()
    assert read_row(path) == OLD
    left = [p.name for p in tmp_path.iterdir() if p.name != "cell.json"]
    assert len(left) == 1 and left[0].startswith(".cell.json.") and left[0].endswith(".tmp")  # hidden
    table = load_results(tmp_path)
    assert len(table) == 1 and table.measured_peak_bytes.tolist() == [1]
    # the next write of the cell replaces the old row whole
    write_row({**OLD, "measured_peak_bytes": 3}, tmp_path, "cell.json")
    assert read_row(path)["measured_peak_bytes"] == 3
