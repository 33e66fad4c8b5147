"""The CLI a new user meets: required settings marked in --help and refused in words, click's own refusals in the
`error:` style of every other message, progress in a log file as whole lines, and a warning when the warmup is
longer than the run."""

from __future__ import annotations

import io
import time

import pytest
from click.testing import CliRunner

from pipeline.cli import main


def invoke(args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_a_missing_required_setting_is_named_in_words(tmp_path):
    r = invoke(["teacher-cache", "--teacher", tmp_path, "--out", tmp_path / "cache"])
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert lines == ["error: give one of --prompts FILE (text-to-video), --images FILE or --images-from CACHE "
                     "(image-to-video)"]
    r = invoke(["train-student", "--out", tmp_path / "run"])
    assert r.exit_code == 2 and "error: --cache is required" in r.output
    assert "__init__" not in r.output and "keyword" not in r.output
    # the student is one of two settings: a compact one or a LoRA of the teacher
    r = invoke(["train-student", "--cache", tmp_path, "--out", tmp_path / "run"])
    assert r.exit_code == 2 and "error: give --student-config (a compact student) or --lora-of TEACHER" in r.output


def test_a_required_setting_in_the_config_file_is_enough(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text(f'prompts = "{tmp_path / "none.txt"}"\n')
    r = invoke(["teacher-cache", "--config", toml, "--teacher", tmp_path, "--out", tmp_path / "cache"])
    assert r.exit_code == 2 and "is required" not in r.output and "none.txt" in r.output


@pytest.mark.parametrize("command, flags", [("teacher-cache", ["--teacher", "--out"]),  # (--prompts or --images)
                                            ("train-student", ["--cache", "--out"]),
                                            ("export", ["--student", "--out"])])
def test_help_marks_the_required_settings(command, flags):
    entries: dict[str, str] = {}  # option -> its help, click's wrapped lines joined
    for line in invoke([command, "--help"]).output.split("Options:")[1].splitlines():
        if line.startswith("  -"):
            flag = line.split()[0]
            entries[flag] = line
        elif line.strip():
            entries[flag] += " " + line.strip()
    required = {flag for flag, text in entries.items() if "[required]" in text}
    assert required == set(flags)


@pytest.mark.parametrize("args, message", [
    (["teacher-cache", "--bogus"], "error: No such option '--bogus'"),
    (["nope"], "error: No such command 'nope'"),
    (["cache", "info"], "error: Missing argument 'CACHE_DIR'"),
    (["train-student", "--epochs", "x"], "error: Invalid value for '--epochs'")])
def test_click_refusals_say_error_like_every_other_message(args, message):
    r = invoke(args)
    assert r.exit_code == 2
    assert r.output.strip().splitlines()[-1].startswith(message) and "Error:" not in r.output


def test_a_log_file_gets_whole_lines_not_carriage_returns():
    from tqdm import tqdm

    from pipeline.progress_bar import LineBar, progress_bar

    log = io.StringIO()  # not a TTY, as a SLURM job's output file
    bar = progress_bar(total=30, desc="train-student", unit="step", file=log, mininterval=0.05)
    assert isinstance(bar, LineBar)
    for i in range(30):
        time.sleep(0.01)
        bar.set_postfix({"loss": f"{1 / (i + 1):.3f}"}, refresh=False)
        bar.update(1)
        if i == 10:
            tqdm.write("a message between two lines", file=log)
    bar.close()
    text = log.getvalue()
    lines = text.splitlines()
    assert "\r" not in text and text.endswith("\n")
    assert "a message between two lines" in lines
    progress = [line for line in lines if line.startswith("train-student:")]
    assert 3 <= len(progress) <= 10, lines  # one per interval (0.3 s of work, 0.05 s apart), not one per update
    assert progress[0].startswith("train-student:   0%") and "30/30" in progress[-1] and "loss=0.033" in progress[-1]
    assert len(progress) == len(set(progress))  # the last state once

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert not isinstance(progress_bar(total=1, file=Terminal()), LineBar)  # a terminal keeps tqdm's bar


@pytest.mark.slow
def test_warmup_longer_than_the_run_is_said_and_the_log_has_no_frames(tiny_cache, tmp_path):
    args = ["train-student", "--cache", tiny_cache, "--student-config", "configs/student-tiny.json", "--out",
            tmp_path / "run", "--max-steps", 5, "--batch-size", 4, "--device", "cpu", "--report-to", "none"]
    warning = ("warning: --warmup-steps 100 is not below the run's 5 optimizer steps: the learning rate climbs the "
               "whole run and peaks at 5e-06, not --lr 0.0001; lower --warmup-steps (e.g. 0) or train longer")
    r = invoke(args + ["--dry-run"])
    assert r.exit_code == 0 and warning in r.output.splitlines()
    assert not (tmp_path / "run").exists()  # a dry run writes nothing
    r = invoke(args)
    assert r.exit_code == 0, r.output
    assert warning in r.output.splitlines() and "\r" not in r.output
    assert any(line.startswith("train-student: 100%") for line in r.output.splitlines())
    r = invoke(args[:-8] + ["--out", tmp_path / "run2", "--max-steps", 5, "--warmup-steps", 2, "--dry-run"])
    assert r.exit_code == 0 and "warning" not in r.output
