"""The ``meshzero`` command's manners: --version, ``python -m meshzero``, --help without torch,
help text on every option, exit codes, one-line errors, and logging through the standard
``logging`` module. Most subprocesses here import no torch, so they cost well under 1 s."""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys

import pytest

import meshzero
from meshzero import log
from meshzero.cli import COMMANDS, EXIT_DOES_NOT_FIT, EXIT_ERROR, EXIT_OK, build_parser, main
from tests.distributed import REPO_ROOT


def run(*args: str, env: dict[str, str] | None = None, code: str | None = None
        ) -> subprocess.CompletedProcess:
    """``python -m meshzero ARGS`` (or ``python -c CODE``) from this checkout's src."""
    paths = [str(REPO_ROOT / "src"), str(REPO_ROOT),
             *filter(None, os.environ.get("PYTHONPATH", "").split(":"))]
    full_env = {**os.environ, "PYTHONPATH": ":".join(paths), **(env or {})}
    for key in (log.LEVEL_ENV, log.ALL_RANKS_ENV, "RANK"):
        if key not in (env or {}):
            full_env.pop(key, None)
    command = ["-c", code] if code is not None else ["-m", "meshzero", *args]
    return subprocess.run([sys.executable, *command], env=full_env, capture_output=True,
                          text=True, timeout=120)


def test_version_and_python_dash_m():
    proc = run("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"meshzero {meshzero.__version__}"
    proc = run("--help")
    assert proc.returncode == 0
    for name, command in COMMANDS.items():
        assert name in proc.stdout and command.summary in proc.stdout
    assert "exit codes:" in proc.stdout and log.LEVEL_ENV in proc.stdout


def test_help_and_version_do_not_import_torch():
    """What made `meshzero --help` take seconds: torch imported before argparse ran."""
    code = ("import sys\nfrom meshzero.cli import main\n"
            "for argv in (['--help'], ['--version'], ['demo', '--help'], "
            "['consolidate', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('torch' in sys.modules, 'numpy' in sys.modules, file=sys.stderr)")
    proc = run(code=code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "False False"
    assert "--nproc" in proc.stdout and "--max-shard-size" in proc.stdout


def test_import_after_torch_loads_the_engine_and_what_it_imports():
    """A training script imports torch, then meshzero: the first engine's imports (its
    modules, torch._dynamo and sympy, which torch.optim pulls on first use) are made there,
    not inside the first ``initialize``, whose memory peak is then the model's own (issue
    26; docs/big-models.md). The command line above imports none of it."""
    code = ("import sys, torch\nimport meshzero\n"
            "print(*(m in sys.modules for m in ('meshzero.engine', 'torch._dynamo', "
            "'sympy', 'pydantic')), file=sys.stderr)")
    proc = run(code=code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "True True True True"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    # argparse has no public way to list a parser's actions
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_option_has_help():
    parser = build_parser()  # every subcommand loaded
    commands = _subparsers(parser)
    assert set(commands) == set(COMMANDS)
    missing = [f"{name} {'/'.join(a.option_strings) or a.dest}"
               for name, p in [("meshzero", parser), *commands.items()]
               for a in p._actions
               if not isinstance(a, argparse._SubParsersAction)
               and (not a.help or a.help == argparse.SUPPRESS)]
    assert not missing, f"options without help text: {missing}"


def test_docs_page_names_every_command_and_option():
    text = (REPO_ROOT / "docs" / "cli.md").read_text()
    commands = _subparsers(build_parser())
    for name, p in commands.items():
        assert f"## `meshzero {name}`" in text
        for action in p._actions:
            for option in action.option_strings:
                assert option.startswith("-h") or option == "--help" or option in text, (
                    name, option)
    for variable in (log.LEVEL_ENV, log.ALL_RANKS_ENV):
        assert variable in text
    for code in (EXIT_OK, EXIT_ERROR, EXIT_DOES_NOT_FIT):
        assert f"| {code} |" in text


def test_estimate_exit_code_says_whether_it_fits(capsys):
    # 7B in fp32 with Adam at stage 0: 16 bytes per parameter, 112 GB, on 80 GB GPUs
    assert main(["estimate", "--params", "7B"]) == EXIT_DOES_NOT_FIT
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main(["estimate", "--params", "7B", "--stage", "3"]) == EXIT_OK
    assert "DOES NOT FIT" not in capsys.readouterr().out
    assert main(["estimate", "--params", "7B", "--json"]) == EXIT_DOES_NOT_FIT
    assert json.loads(capsys.readouterr().out)["fits"] is False


def test_plan_exit_code_when_nothing_fits(capsys):
    assert main(["plan", "--params", "7B", "--largest-unit", "200M", "--seq-len", "2048",
                 "--gpus-per-node", "1", "--gpu-memory", "1GB"]) == EXIT_DOES_NOT_FIT
    out = capsys.readouterr().out
    assert out.startswith("meshzero plan: no configuration fits") and "Traceback" not in out


def test_user_errors_are_one_line_without_a_traceback(tmp_path, capsys):
    cases = [
        (["estimate", "no_such_pkg:factory"], "no_such_pkg"),
        (["consolidate", str(tmp_path / "nonexistent"), str(tmp_path / "out")],
         "does not exist"),
        (["demo", "--config", str(tmp_path / "missing.json")], "does not exist"),
        (["plan", "--params", "1B", "--top", "-1"], "--top must be 0"),
        (["plan", "--params", "1B", "--write-config", str(tmp_path / "no" / "x.json")],
         "the directory does not exist"),
    ]
    for argv, expected in cases:
        assert main(argv) == EXIT_ERROR, argv
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"meshzero {argv[0]}: error: "), lines
        assert expected in lines[0]
    # the same in a real process (an error found before torch is imported: fast)
    proc = run("consolidate", "ckpt", "out", env={log.LEVEL_ENV: "LOUD"})
    assert proc.returncode == EXIT_ERROR
    assert proc.stderr.splitlines() == [
        "meshzero consolidate: error: MESHZERO_LOG_LEVEL='LOUD' is not a level; use one of "
        "DEBUG, INFO, WARNING, ERROR, CRITICAL"]
    # MESHZERO_LOG_LEVEL=DEBUG shows the traceback
    proc = run("consolidate", "ckpt", "out",
               env={log.LEVEL_ENV: "DEBUG", log.ALL_RANKS_ENV: "maybe"})
    assert proc.returncode == 1 and "Traceback" in proc.stderr
    assert "MESHZERO_LOG_ALL_RANKS='maybe'" in proc.stderr


def test_consolidate_names_a_missing_directory(tmp_path, capsys):
    assert main(["consolidate", str(tmp_path / "nope"), str(tmp_path / "out")]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "does not exist" in err and "latest" not in err
    (tmp_path / "file").write_text("")
    assert main(["consolidate", str(tmp_path / "file"), str(tmp_path / "out")]) == EXIT_ERROR
    assert "is not a directory" in capsys.readouterr().err


def test_seq_len_beyond_a_learned_position_table_is_refused(tmp_path, capsys):
    """GPT-2's positions are a learned table of n_positions rows: a longer sequence fails in
    a real forward (fake tensors do not check), so the estimate refuses it; Llama's rotary
    positions run beyond max_position_embeddings: a note, not an error."""
    pytest.importorskip("transformers")
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 64, "n_positions": 32,
                                "n_embd": 16, "n_layer": 2, "n_head": 2,
                                "bos_token_id": 0, "eos_token_id": 0}))
    assert main(["estimate", str(gpt2), "--seq-len", "64"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "seq_len 64 is longer than the model's n_positions = 32" in err
    llama = tmp_path / "llama.json"
    llama.write_text(json.dumps({
        "model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 32}))
    assert main(["estimate", str(llama), "--seq-len", "64"]) == EXIT_OK
    assert "longer than the model's max_position_embeddings = 32" in capsys.readouterr().out


def test_demo_gpt_seq_len_refused(capsys):
    for command in ("estimate", "plan"):
        assert main([command, "meshzero.demo.gpt:GPT", "--seq-len", "4096"]) == EXIT_ERROR
        assert "seq_len 4096 is longer than the model's block_size = 128" in (
            capsys.readouterr().err)


def test_plan_order_does_not_depend_on_the_order_tried():
    from meshzero.estimate import Cluster
    from meshzero.estimate.plan import _rank, plan

    # no model to run: every micro batch is 1, so many rows tie on tokens/s
    result = plan(params="1B", largest_unit="50M", seq_len=512,
                  cluster=Cluster(gpus_per_node=4, gpu_memory="40GB"))
    rows = result.candidates
    assert len({round(c.tokens_per_s) for c in rows}) < len(rows)  # there are ties
    for seed in range(5):
        shuffled = rows[:]
        random.Random(seed).shuffle(shuffled)
        assert sorted(shuffled, key=_rank) == rows
    assert len({_rank(c) for c in rows}) == len(rows)  # a total order: no two rows equal


@pytest.fixture
def meshzero_logger():
    """Restore the ``meshzero`` logger after a test changes it."""
    logger = logging.getLogger("meshzero")
    saved = (logger.level, logger.handlers[:], logger.propagate)
    yield logger
    logger.setLevel(saved[0])
    logger.handlers[:] = saved[1]
    logger.propagate = saved[2]


def test_logging_propagates_rank_zero_only(meshzero_logger, caplog, monkeypatch):
    monkeypatch.delenv(log.LEVEL_ENV, raising=False)
    monkeypatch.delenv(log.ALL_RANKS_ENV, raising=False)
    child = logging.getLogger("meshzero.some.module")
    caplog.set_level(logging.INFO)  # the user's configuration: root at INFO, a handler
    log.setup_logging(rank=0)
    child.info("from rank 0")
    assert meshzero_logger.propagate
    assert [r.getMessage() for r in caplog.records] == ["from rank 0"]
    caplog.clear()
    meshzero_logger.setLevel(logging.NOTSET)
    log.setup_logging(rank=1)
    child.info("info from rank 1")
    child.warning("warning from rank 1")
    assert [r.getMessage() for r in caplog.records] == ["warning from rank 1"]
    caplog.clear()
    meshzero_logger.setLevel(logging.NOTSET)
    monkeypatch.setenv(log.ALL_RANKS_ENV, "1")
    monkeypatch.setenv(log.LEVEL_ENV, "debug")
    caplog.handler.setLevel(logging.DEBUG)
    log.setup_logging(rank=1)
    child.debug("debug from rank 1")
    assert [r.getMessage() for r in caplog.records] == ["debug from rank 1"]
    monkeypatch.setenv(log.LEVEL_ENV, "LOUD")
    with pytest.raises(ValueError, match="MESHZERO_LOG_LEVEL='LOUD' is not a level"):
        log.setup_logging(rank=0)


def test_own_handler_only_without_a_user_configuration():
    """No logging configured: meshzero prints with its rank prefix. basicConfig before or
    after setup: the user's format, each message once."""
    emit = "import logging; logging.getLogger('meshzero.x').info('hello')\n"
    setup = "from meshzero.log import setup_logging; setup_logging()\n"
    basic = ("import logging; logging.basicConfig(level=logging.INFO, "
             "format='USER %(name)s %(message)s')\n")
    proc = run(code=setup + emit)
    assert proc.stderr.strip().splitlines() == ["[meshzero rank 0] INFO hello"]
    for code in (basic + setup + emit, setup + basic + emit):
        proc = run(code=code)
        assert proc.stderr.strip().splitlines() == ["USER meshzero.x hello"], code
    proc = run(code=setup + emit, env={log.LEVEL_ENV: "WARNING"})
    assert proc.stderr.strip() == ""
