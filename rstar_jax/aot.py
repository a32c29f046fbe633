"""`python -m rstar_jax.aot --config=configs/stage1.py --devices=64 [--config.a.b=v ...]`: the
config's GRPO-RoC update and SFT step compiled ahead of time over that many abstract devices (fake
CPU devices, abstract arrays: no weights, no accelerator), and the engine's prefill and decode at
`--generation_tp`, with XLA's per-device memory analysis
beside the memory plan and an MI300X's and an H100's memory (see `rstar_jax.app.aot`).
"""

from __future__ import annotations

from absl import flags

from rstar_jax.config.cli import config_command
from rstar_jax.config import DEFAULT_CONFIG

LIBRARIES = ("jax", "rstar_jax.app.aot")  # imported by run(), after the flags are parsed
_DEVICES = flags.DEFINE_integer("devices", 64, "Devices of the abstract cluster (fake CPU devices).")
_GENERATION_TP = flags.DEFINE_integer("generation_tp", 4, "Tensor-parallel size of a generation replica (the "
                                      "release served the 14B policy at TP 4); 0 skips the engine.")


def run(config) -> None:
    import jax

    # The abstract cluster: that many CPU devices, set before JAX starts its backend.
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", _DEVICES.value)

    from rstar_jax.app import builders
    from rstar_jax.app.aot import compile_engine, compile_steps, report
    from rstar_jax.parallel import make_mesh

    mesh = make_mesh(*builders.check_mesh(config, jax.device_count()))
    steps = compile_steps(config, mesh)
    if _GENERATION_TP.value:
        steps += compile_engine(config, _GENERATION_TP.value)
    print(report(config, mesh, steps), flush=True)


def main() -> None:
    config_command(DEFAULT_CONFIG, run, check_files=False, libraries=LIBRARIES)


if __name__ == "__main__":
    main()
