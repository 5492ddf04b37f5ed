"""`torchrun` entry point: Axolotl 0.21's own `axolotl.cli.train`, on CPU ranks (gloo).

Axolotl 0.21 assumes a GPU per rank whenever WORLD_SIZE > 1, in two places, and nothing else in
it needs one. This entry answers those two, then runs Axolotl's train command unchanged:
- accelerate picks gloo for CPU ranks only when told `cpu=True` (what `accelerate launch --cpu`
  does, through ACCELERATE_USE_CPU, which the Trainer reads too).
- `prepare_optim_env` probes CUDA peer-to-peer access (raises without a driver); the answer only
  decides NCCL_P2P_DISABLE, which gloo ignores: answered "no P2P".
- `normalize_config` sets `device_map = {"": LOCAL_RANK}`, an integer meaning a CUDA device: on a
  machine without CUDA it is set to the CPU after normalisation.
    torchrun --nproc_per_node 2 tests/axolotl_cpu_ranks.py config.yml
"""

import os
import sys

import axolotl.cli.config
import axolotl.utils.trainer
import torch
from accelerate import PartialState

if not torch.cuda.is_available():
    os.environ["ACCELERATE_USE_CPU"] = "true"
    PartialState(cpu=True)
axolotl.utils.trainer.check_cuda_p2p_ib_support = lambda: False
_normalize = axolotl.cli.config.normalize_config


def _normalize_on_cpu(cfg):
    _normalize(cfg)
    if not torch.cuda.is_available():
        cfg.device_map = {"": "cpu"}


axolotl.cli.config.normalize_config = _normalize_on_cpu

from axolotl.cli.train import do_cli  # noqa: E402

if __name__ == "__main__":
    do_cli(config=sys.argv[1])
