"""diffjax: the Differential Transformer in JAX/Flax."""

import sys

from diffjax import host as _host

# Scripts and notebooks that import diffjax import jax quietly (host.QuietJaxImport); the backends start later,
# quietly where `host.cpu_unless_accelerator()` starts them (a multi-process launch initialises jax.distributed first).
if "jax" not in sys.modules and not any(isinstance(f, _host.QuietJaxImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _host.QuietJaxImport())
