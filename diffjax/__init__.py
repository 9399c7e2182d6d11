"""diffjax: the Differential Transformer in JAX/Flax."""

import sys

from diffjax import host as _host

# Scripts and notebooks that import diffjax import jax quietly, its plugins with it (host.QuietJaxImport); the
# backends start later (a multi-process launch initialises jax.distributed first).
if "jax" not in sys.modules and not any(isinstance(f, _host.QuietJaxImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _host.QuietJaxImport())
