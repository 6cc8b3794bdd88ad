"""The training command as its launcher reads it."""

import sys

import pytest

from memplan.errors import UserError
from memplan.program.launchers import parse_command


def test_python_runs_its_script_with_the_arguments_as_typed():
    launch = parse_command(["python3", "-u", "train.py", "--lr", "1e-4", "--data", "x y"])
    assert (launch.launcher, launch.target, launch.args) == ("python", "train.py", ("--lr", "1e-4", "--data", "x y"))
    assert launch.world_size == 1 and launch.rank_env(0) == {}


def test_python_m_runs_a_module():
    launch = parse_command(["python", "-m", "trainer.main", "--epochs", "1"])
    assert launch.module and launch.target == "trainer.main" and launch.args == ("--epochs", "1")


def test_torchrun_world_is_nodes_times_processes_per_node():
    launch = parse_command(["torchrun", "--nnodes", "4", "--nproc-per-node", "8", "train.py", "--bf16"])
    assert (launch.world_size, launch.nproc_per_node, launch.target, launch.args) == (32, 8, "train.py", ("--bf16",))
    env = launch.rank_env(9)
    assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == \
        ("9", "1", "1", "32", "8")


def test_python_m_torch_distributed_run_is_torchrun():
    launch = parse_command(["python", "-m", "torch.distributed.run", "--nproc_per_node=2", "train.py"])
    assert launch.launcher == "torchrun" and launch.world_size == 2


def test_an_unknown_launcher_is_refused_naming_those_supported():
    with pytest.raises(UserError, match="does not know the launcher `mpirun`: it runs accelerate, deepspeed, litgpt, "
                                        "python, torchrun, trl, tune"):
        parse_command(["mpirun", "-np", "2", "python", "train.py"])


def test_torchrun_without_a_number_of_processes_is_refused():
    with pytest.raises(UserError, match="--nproc-per-node gpu"):
        parse_command(["torchrun", "--nproc-per-node", "gpu", "train.py"])


FSDP2_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_machines: 1
num_processes: 4
mixed_precision: bf16
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
"""


def test_accelerate_launch_reads_its_config_file_and_gives_each_rank_its_environment(tmp_path):
    config = tmp_path / "fsdp.yaml"
    config.write_text(FSDP2_CONFIG)
    launch = parse_command(["accelerate", "launch", "--config_file", str(config), "train.py", "--lr", "1"])
    assert (launch.launcher, launch.world_size, launch.nproc_per_node, launch.args) == ("accelerate", 4, 4, ("--lr", "1"))
    env = launch.rank_env(3)
    assert (env["ACCELERATE_USE_FSDP"], env["FSDP_VERSION"], env["ACCELERATE_MIXED_PRECISION"], env["RANK"]) == \
        ("true", "2", "bf16", "3")


def test_trl_sft_is_read_by_trls_cli_as_an_accelerate_launch_of_its_sft_script():
    launch = parse_command(["trl", "sft", "--model_name_or_path", "tiny", "--dataset_name", "data", "--output_dir",
                            "out", "--bf16", "false"])
    assert (launch.launcher, launch.world_size, launch.entry) == ("trl", 1, None)
    assert launch.target.endswith("trl/scripts/sft.py")
    assert launch.args[launch.args.index("--model_name_or_path") + 1] == "tiny"


def test_litgpt_runs_its_console_scripts_entry_point_with_the_command_as_typed():
    launch = parse_command(["litgpt", "finetune_lora", "checkpoints/tiny", "--data", "JSON"])
    assert (launch.launcher, launch.entry, launch.args) == \
        ("litgpt", "litgpt.__main__:main", ("finetune_lora", "checkpoints/tiny", "--data", "JSON"))


def test_tune_run_without_an_importable_torchtune_is_refused_saying_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchtune._cli.run", None)  # what an import that fails raises
    with pytest.raises(UserError, match="`tune run` needs torchtune, which does not import here"):
        parse_command(["tune", "run", "full_finetune_single_device", "--config", "my.yaml"])


def test_tune_other_than_run_is_refused():
    with pytest.raises(UserError, match="runs `tune run RECIPE --config CONFIG`, not `tune download`"):
        parse_command(["tune", "download", "meta-llama/Llama-3.2-1B"])


DEEPSPEED_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: 2
  gradient_accumulation_steps: 1
num_machines: 1
num_processes: 2
mixed_precision: 'no'
"""


def test_accelerate_launch_with_a_deepspeed_config_gives_each_rank_deepspeeds_environment(tmp_path):
    config = tmp_path / "ds.yaml"
    config.write_text(DEEPSPEED_CONFIG)
    launch = parse_command(["accelerate", "launch", "--config_file", str(config), "train.py"])
    assert (launch.world_size, launch.nproc_per_node, launch.distributed) == (2, 2, True)
    env = launch.rank_env(1)
    assert (env["ACCELERATE_USE_DEEPSPEED"], env["ACCELERATE_DEEPSPEED_ZERO_STAGE"], env["RANK"]) == ("true", "2", "1")


def test_accelerate_launch_with_deepspeed_on_several_machines_is_refused():
    with pytest.raises(UserError, match="DeepSpeed on several machines"):
        parse_command(["accelerate", "launch", "--use_deepspeed", "--num_machines", "2", "--num_processes", "4",
                       "--machine_rank", "0", "--main_process_ip", "10.0.0.1", "train.py"])


def test_deepspeed_world_is_num_gpus_and_each_rank_gets_local_rank_before_its_arguments():
    launch = parse_command(["deepspeed", "--num_gpus", "4", "--master_port", "29700", "train.py", "--deepspeed",
                            "--deepspeed_config", "ds.json"])
    assert (launch.launcher, launch.world_size, launch.nproc_per_node, launch.target) == ("deepspeed", 4, 4, "train.py")
    assert launch.rank_args(2) == ("--local_rank=2", "--deepspeed", "--deepspeed_config", "ds.json")
    env = launch.rank_env(3)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_SIZE"], env["MASTER_PORT"]) == \
        ("3", "3", "4", "4", "29700")


def test_deepspeed_no_local_rank_passes_the_arguments_as_typed():
    launch = parse_command(["deepspeed", "--num_gpus", "2", "--no_local_rank", "train.py", "--lr", "1"])
    assert launch.rank_args(1) == ("--lr", "1")


def test_deepspeed_hostfile_gives_nodes_times_slots(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=8\nnode2 slots=8\n")
    launch = parse_command(["deepspeed", "--hostfile", str(hostfile), "train.py"])
    assert (launch.world_size, launch.nproc_per_node) == (16, 8)
    assert launch.rank_env(9)["CROSS_RANK"] == "1" and launch.rank_env(9)["LOCAL_RANK"] == "1"


def test_deepspeed_without_num_gpus_or_hostfile_is_refused():
    with pytest.raises(UserError, match="give --num_gpus N"):
        parse_command(["deepspeed", "train.py"])
