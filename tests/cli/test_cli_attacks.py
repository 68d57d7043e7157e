"""A hostile user against every `rapidfire` subcommand (issue 43): bad paths, a file where a folder goes,
folders that cannot be created, 300-character names, garbage and binary files, missing files, another
working directory. Each ends in one line on stderr naming the problem, exit status 2, never a traceback;
`--debug` shows the traceback."""

from __future__ import annotations

import pytest

from rapidfire_hf.cli.main import main

LONG = "x" * 300
SWEEP = """reward_funcs: [demo]
model: demo
config: {output_dir: OUT, max_steps: 1, use_cpu: true}
trials:
  a: {kl_coef: 0.1}
"""

# (argv with {t} for a prepared folder, what the one line must say); {t}/afile is a file, {t}/adir a folder
ATTACKS = [
    (["demo", "--output-dir", "{t}/afile/sub", "--steps", "1", "--cpu"], "afile/sub: Not a directory"),
    (["demo", "--output-dir", "{t}/afile", "--steps", "1", "--cpu"], "afile: File exists"),
    (["demo", "--output-dir", "{t}/" + LONG, "--steps", "1", "--cpu"], "characters): File name too long"),
    (["demo", "--model", "{t}/afile", "--cpu"], "not a folder of a HF model (no config.json in it)"),
    (["demo", "--resume", "--cpu", "--steps", "1", "--output-dir", "{t}/adir"], "--resume: resume_from_checkpoint=True but"),
    (["demo", "--config", "{t}/binary.yaml"], "cannot read the file"),
    (["demo", "--learning-rate", "nan", "--cpu", "--output-dir", "{t}/o"], "learning_rate=nan: invalid value"),
    (["bench", "ppo", "--out", "{t}/afile/sub", "--smoke"], "afile/sub: Not a directory"),
    (["config", "validate", "{t}/binary.yaml"], "cannot read the file"),
    (["config", "validate", "{t}/" + LONG + ".yaml"], "File name too long"),
    (["sweep", "{t}/" + LONG + ".yaml"], "File name too long"),
    (["sweep", "{t}/binary.yaml"], "cannot read the file"),
    (["sweep", "{t}/garbage.yaml"], "garbage.yaml"),
    (["sweep", "sweep_afile_sub.yaml", "--no-progress"], "output_dir {t}/afile/sub cannot be written (Not a directory)"),
    (["sweep", "sweep_afile_sub.yaml", "--no-progress", "--resume"], "output_dir {t}/afile/sub cannot be written"),
    (["sweep", "sweep_long.yaml", "--no-progress"], "File name too long"),
    (["sweep", "sweep_fresh.yaml", "--no-progress", "--resume"], "holds no sweep_checkpoint.json"),
    (["sweep", "ctl", "--dir", "{t}/afile", "status"], "no such folder"),
    (["sweep", "ctl", "--dir", "{t}/badstate", "stop", "a"], "badstate/sweep_state.json is not valid JSON"),
    (["sweep", "ctl", "--dir", "{t}/running", "stop", "a"], "control.jsonl: Is a directory"),
    (["sweep", "ctl", "--dir", "{t}/running", "clone", "a", LONG], "is 300 characters long: at most 128"),
]


@pytest.fixture()
def hostile(tmp_path, monkeypatch):
    """A folder of bad inputs; the working directory is another folder (relative sweep files from there)."""
    (tmp_path / "afile").write_text("a file, not a folder")
    (tmp_path / "adir").mkdir()
    (tmp_path / "binary.yaml").write_bytes(bytes(range(256)))
    (tmp_path / "garbage.yaml").write_text("trials: [unclosed\n")
    (tmp_path / "badstate").mkdir()
    (tmp_path / "badstate" / "sweep_state.json").write_text("not json")
    running = tmp_path / "running"  # a running sweep's state (another host: never judged gone)
    (running / "control.jsonl").mkdir(parents=True)
    (running / "sweep_state.json").write_text('{"status": "running", "pid": 1, "host": "elsewhere", '
                                              '"trials": {"a": {"state": "running"}}}')  # fmt: skip
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    for name, out in (("afile_sub", tmp_path / "afile" / "sub"), ("long", tmp_path / LONG[:200] / LONG),
                      ("fresh", tmp_path / "fresh")):  # fmt: skip
        (cwd / f"sweep_{name}.yaml").write_text(SWEEP.replace("OUT", str(out)))
    monkeypatch.chdir(cwd)
    return tmp_path


@pytest.mark.parametrize(("argv", "says"), ATTACKS, ids=[" ".join(a[:3])[:50] for a, _ in ATTACKS])
@pytest.mark.usefixtures("single_thread")
def test_a_hostile_input_is_one_line_and_status_2(hostile, capsys, argv, says):
    argv = [a.replace("{t}", str(hostile)) for a in argv]
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own refusals
        code = exit_.code
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("rapidfire")]
    assert code == 2, (code, err[-2000:])
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith(f"rapidfire {argv[0]}: error: "), err[-2000:]
    assert says.replace("{t}", str(hostile)) in lines[0], lines[0]


def test_debug_shows_the_traceback_of_an_os_error(hostile):
    with pytest.raises(NotADirectoryError):
        main(["--debug", "demo", "--output-dir", f"{hostile}/afile/sub", "--cpu"])
