"""The training runtime: config, engine, ZeRO stages, precision, optimizers, checkpoints."""
