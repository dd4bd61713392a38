"""The documentation's commands: the Usage page's script and config run as shown, and every
shell command in README.md and docs/ is either run by a test or CI step named here, or says
why it cannot be (network installs, several nodes, GPUs, minutes-long benchmarks)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.distributed import REPO_ROOT

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]

# command -> the test (path::function) or CI step that runs it, or "not run: why"
EXAMPLE = "tests/test_hf_trainer.py::runs"
COVERED: dict[str, str] = {
    "pip install torch==2.13.0 && pip install -e . && meshzero demo": "ci: .ci/run installs "
        "torch==2.13.0 and the package; tests/test_demo.py::test_demo_trains_and_reports",
    "pip install -e '.[test]' && python -m pytest -q -m \"not slow\"": "ci: .ci/run",
    "pip install torch==2.13.0": "ci: .ci/run",
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu":
        "not run: installs from PyTorch's index (network); CI installs torch==2.13.0",
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128":
        "not run: a CUDA build; CI has no GPU",
    "pip install -e .": "ci: .ci/run",
    "pip install -e '.[hf]'": "not run: a subset of the test extra, which CI installs",
    "pip install -e '.[test]'": "ci: .ci/run",
    "pip install -e '.[docs]'": "ci: .ci/run",
    "python -m pytest -q -m \"not slow\"": "ci: .ci/run",
    "python -m pytest -q -m slow": "not run: the slow set, run by hand",
    "mkdocs build --strict": "ci: .ci/run",
    "pip install -e '.[bench]'": "not run: DeepSpeed, optional",
    "pip install --no-deps deepspeed==0.19.8 einops hjson msgpack ninja psutil py-cpuinfo":
        "not run: DeepSpeed, optional",
    "python benchmarks/compare.py": "not run: minutes-long; its --tiny form is "
        "tests/test_benchmarks.py::test_compare_runs_and_prints_a_row_per_system_and_stage",
    "python benchmarks/compare.py --model mlp": "not run: minutes-long, as above",
    "python benchmarks/compare.py --model gpt --nproc 4 --systems meshzero,fsdp2,deepspeed "
    "--stages 3 --offload none --steps 5 --warmup 2 --bf16 --write-results":
        "not run: minutes-long, as above",
    "python benchmarks/compile.py": "not run: minutes-long; its tiny form runs in "
        "tests/test_benchmarks.py::test_gpu_check_dry_run_passes_on_cpu (gpu_check.sh)",
    "python benchmarks/compile.py --world 2": "not run: minutes-long, as above",
    "bash benchmarks/gpu_check.sh": "not run: needs a GPU; its dry run is "
    "tests/test_benchmarks.py::test_gpu_check_dry_run_passes_on_cpu",
    "bash benchmarks/gpu_check.sh --dry-run":
        "tests/test_benchmarks.py::test_gpu_check_dry_run_passes_on_cpu (slow set)",
    "python benchmarks/compare.py --systems meshzero,fsdp2 --steps 2 --warmup 1 --tiny":
        "tests/test_benchmarks.py::test_compare_runs_and_prints_a_row_per_system_and_stage",
    "meshzero estimate meshzero.demo.gpt:GPT --gpus-per-node 4 --gpu-memory 16GB --stage 3 "
    "--precision bf16 --micro-batch 16": "tests/test_estimate.py::test_cli",
    "meshzero estimate llama-70b/config.json --nodes 4 --gpus-per-node 8 --stage 3 "
    "--precision bf16 --seq-len 4096 --activation-checkpointing":
        "tests/test_estimate.py::test_hugging_face_config (a small config.json of the user's)",
    "meshzero estimate my_pkg.model:build --config ds_config.json --nodes 2 --gpus-per-node 8 "
    "--json": "tests/test_estimate.py::test_cli (a factory of the user's, --json)",
    "meshzero estimate --params 70B --largest-unit 900M --nodes 4 --stage 3 --precision bf16 "
    "--activation-memory 12GB": "tests/test_estimate.py::test_params_only",
    "meshzero estimate meshzero.demo.gpt:GPT --nodes 2 --gpus-per-node 4 --gpu-memory 80GB "
    "--tp 2 --tp-plan gpt --pp 2 --stage 1 --precision bf16 --micro-batch 8 "
    "--pp-micro-batches 4 --pipeline-layout meshzero.demo.layout:GPT_LAYOUT":
        "tests/test_estimate_mesh.py::test_cli_tp_pp",
    "meshzero plan llama-70b/config.json --nodes 4 --gpus-per-node 8 --gpu-memory 80GB "
    "--host-memory 1TB --precision bf16 --seq-len 4096 --global-batch 256 "
    "--activation-checkpointing --top 8 --write-config best.json":
        "tests/test_plan.py::test_cli (a config.json of the user's)",
    "meshzero plan llama-70b/config.json --nodes 4 --gpus-per-node 8 --gpu-memory 80GB "
    "--host-memory 1TB --precision bf16 --seq-len 4096 --global-batch 256 "
    "--activation-checkpointing --search-mesh --top 8": "tests/test_plan.py::test_search_mesh_cli",
    "meshzero consolidate ckpt out/ [--tag global_step1000] [--dtype fp32|bf16|fp16] "
    "[--max-shard-size 5GB]": "tests/test_consolidate.py::test_cli_consolidate",
    "python examples/hf_trainer.py --out runs/plain --plain --per-device 4": EXAMPLE,
    "python examples/trl_trainers.py --out runs/plain --plain --per-device 4 --cases "
    "sft-lora,dpo": "tests/test_hf_trl.py::runs",
    "torchrun --nproc-per-node 2 examples/trl_trainers.py --out runs/zero --cases "
    "sft-lora,dpo:2": "tests/test_hf_trl.py::runs",
    "torchrun --nproc-per-node 2 examples/hf_trainer.py --out runs/zero3 --save-steps 3": EXAMPLE,
    "torchrun --nproc-per-node 2 examples/hf_trainer.py --out runs/sp2 --sp 2":
        "tests/test_hf_trainer.py::test_sequence_parallel_matches_plain_trainer",
    "python benchmarks/sequence_parallel.py --steps 5": "not run: minutes-long; its figures "
        "are in docs/long-sequences.md and benchmarks/RESULTS.md",
    "python examples/hf_trainer.py --out runs/resumed --per-device 4 --resume "
    "runs/zero3/checkpoint-3":
        "tests/test_hf_trainer.py::test_resume_at_world_size_one_continues_identically",
    "torchrun --standalone --nproc-per-node 2 train.py":
        "tests/test_docs.py::test_usage_script_runs_as_shown",
    "python examples/train_minimal.py": "tests/test_examples.py::test_train_minimal_loss_falls",
    "torchrun --nproc-per-node 2 examples/train_minimal.py --steps 30":
        "tests/test_examples.py::test_train_minimal_loss_falls",
    "meshzero demo --nproc 2 --steps 20": "tests/test_demo.py::test_demo_trains_and_reports",
    "meshzero demo --config examples/configs/zero2.json":
        "tests/test_example_configs.py::test_config_trains_three_steps_on_two_ranks",
    "meshzero demo --scaling": "tests/test_demo.py::test_scaling_halves_model_state_bytes_per_rank",
    "meshzero env": "not run: prints this machine's setup",
    "torchrun --standalone --nproc-per-node 4 train.py":
        "tests/test_docs.py::test_usage_script_runs_as_shown (2 ranks)",
    "torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --rdzv-endpoint node0:29500 train.py":
        "not run: two nodes",
    # docs/cli.md
    "meshzero --version": "ci: .ci/fresh-env; tests/test_cli.py::test_version_and_python_dash_m",
    "meshzero --help": "tests/test_cli.py::test_help_and_version_do_not_import_torch",
    "meshzero COMMAND --help": "tests/test_cli.py::test_every_option_has_help",
    "if meshzero estimate --params 7B --stage 3 > estimate.txt; then":
        "tests/test_cli.py::test_estimate_exit_code_says_whether_it_fits (the exit codes)",
    "echo \"fits\"": "shell around the exit code, as above",
    "elif [ $? -eq 3 ]; then": "shell around the exit code, as above",
    "echo \"does not fit\"": "shell around the exit code, as above",
    "fi": "shell around the exit code, as above",
    "meshzero demo --nproc 2 --steps 3": "ci: .ci/fresh-env",
    "meshzero consolidate CKPT_DIR OUT [--tag TAG] [--dtype fp32|bf16|fp16] "
    "[--max-shard-size 5GB]": "tests/test_consolidate.py::test_cli_consolidate (synopsis)",
    "meshzero estimate MODEL|--params N [--nodes N --gpus-per-node G --gpu-memory M ...]":
        "tests/test_estimate.py::test_cli (synopsis)",
    "meshzero plan MODEL|--params N [--nodes N --gpus-per-node G --gpu-memory M ...]":
        "tests/test_plan.py::test_cli (synopsis)",
}


def shell_commands(text: str) -> list[str]:
    """Each command of every ```bash block: continuations joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").split("\n"):
            line = re.split(r"\s+#\s", line.strip())[0]
            if line and not line.startswith("#"):
                commands.append(" ".join(line.split()))
    return commands


def test_every_documented_command_is_covered() -> None:
    shown = {c for page in DOCS for c in shell_commands(page.read_text())}
    assert shown - COVERED.keys() == set(), "commands in the docs no test or CI step runs"
    assert COVERED.keys() - shown == set(), "entries for commands the docs no longer show"
    for where in COVERED.values():
        for path, name in re.findall(r"(tests/\w+\.py)::(\w+)", where):
            assert re.search(rf"^def {name}\(", (REPO_ROOT / path).read_text(), re.M), where
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert "mkdocs build --strict" in ci and "pytest -q -m \"not slow\"" in ci


def _block(text: str, lang: str, first_line: str | None = None) -> str:
    for block in re.findall(rf"```{lang}\n(.*?)```", text, re.S):
        if first_line is None or block.startswith(first_line):
            return block
    raise AssertionError(f"no ```{lang} block starting {first_line!r}")


def test_usage_script_runs_as_shown(tmp_path: Path) -> None:
    """The Usage page's ds_config.json and train.py, saved as shown, under torchrun."""
    page = (REPO_ROOT / "docs" / "usage.md").read_text()
    (tmp_path / "ds_config.json").write_text(_block(page, "json"))
    (tmp_path / "train.py").write_text(_block(page, "python", "# train.py"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    # 1024 samples / 2 ranks / micro batch 8 = 64 micro-steps per epoch, 2 per step
    assert "epoch 1 loss" in proc.stdout and "optimizer steps 64" in proc.stdout, proc.stdout
