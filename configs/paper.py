"""The paper's models with their training recipes.

    diffjax summary --config configs/paper.py:size=1.4B,arch=diff
    sizes: 830M 1.4B 2.8B 6.8B 13.1B (Appendix E) and 3B (Table 9); arch: diff | transformer | diff_v2
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import sizes  # noqa: E402

from diffjax.config import Config  # noqa: E402


def get_config(arg: str = ""):
    size, arch = sizes.size_and_arch(arg, "configs/paper.py", default_size="1.4B")
    optim, data, train = sizes.paper_recipe(size)
    model = sizes.model_config(size, arch, scan_layers=True, remat=True)
    return Config(model=model, data=data, optim=optim, train=train, name=f"paper-{size}-{arch}")
