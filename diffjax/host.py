"""What this host has: on a machine without accelerator devices, JAX is told to use the CPU.

The compile extra installs TPU and CUDA plugins; on a host without their devices, probing them only prints errors
(a traceback from the CUDA plugin, libtpu's warnings) before every command and in every notebook's output.
"""

from __future__ import annotations

import glob
import os


def accelerator_attached() -> bool:
    """A GPU (/dev/nvidia0…) or TPU (/dev/accel0…, /dev/vfio/0…) device node on this host."""
    return any(glob.glob(pattern) for pattern in ("/dev/nvidia[0-9]*", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*"))


def cpu_unless_accelerator() -> None:
    """Select JAX's CPU platform where no accelerator is attached (JAX_PLATFORMS, when set, decides)."""
    if "JAX_PLATFORMS" not in os.environ and not accelerator_attached():
        import jax

        jax.config.update("jax_platforms", "cpu")
