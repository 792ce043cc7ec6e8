"""scripts/cpu_timeline.py: the busy process is named with the cores it took, and the command's exit
status is the script's."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from cpu_timeline import main  # noqa: E402

# spins 1.6 s after writing its pid, then exits 3
BUSY = (
    "import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\n"
    "t = time.time()\nwhile time.time() - t < 1.6: pass\nsys.exit(3)"
)


def test_a_busy_child_is_seen_at_about_one_core_and_its_exit_status_passes_through(tmp_path):
    out, pid_file = tmp_path / "timeline.txt", tmp_path / "pid"
    assert main(["--out", str(out), "--", sys.executable, "-c", BUSY, str(pid_file)]) == 3
    lines = out.read_text().splitlines()
    pid = pid_file.read_text()
    # after the time and the machine's cores, each line lists "cores pid title" per busy process
    cores = [float(m.group(1)) for line in lines for m in re.finditer(rf"(\d+\.\d\d) {pid} ", line)]
    assert len(cores) >= 2, lines
    assert max(cores) > 0.7, lines  # a whole core while it spins


def test_no_command_is_a_usage_error():
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
