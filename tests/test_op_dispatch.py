"""benchmarks/op_dispatch.py: both registrations timed, the numbers and the run folder written, bad counts refused."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import op_dispatch  # noqa: E402


def test_times_both_registrations_and_writes_the_run_folder(tmp_path, capsys):
    assert op_dispatch.main(["--calls", "200", "--repeats", "3", "--out-root", str(tmp_path)]) == 0
    (run,) = tmp_path.iterdir()
    numbers = json.loads((run / "numbers.json").read_text())
    names = ["torch.library.custom_op", "direct (custom_ops.register)"]
    assert all(numbers[n]["repeats"] == 3 and numbers[n]["q1_us"] <= numbers[n]["median_us"] <= numbers[n]["q3_us"]
               for n in names)
    assert numbers["ratio_custom_op_over_direct"] == pytest.approx(
        numbers[names[0]]["median_us"] / numbers[names[1]]["median_us"])
    assert (run / "env.json").exists() and "| direct (custom_ops.register) |" in (run / "README.md").read_text()
    assert "wrote" in capsys.readouterr().out
    assert op_dispatch.main(["--calls", "10", "--repeats", "1", "--out-root", str(tmp_path / "again")]) == 0  # again


def test_bad_counts_are_refused():
    with pytest.raises(SystemExit):
        op_dispatch.main(["--calls", "0"])
