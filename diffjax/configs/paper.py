"""The paper's models with their training recipes.

    diffjax summary --config configs/paper.py:size=1.4B,arch=diff
    sizes: 830M 1.4B 2.8B 6.8B 13.1B (Appendix E) and 3B (Table 9); arch: any registered; gate (gated only):
    headwise | elementwise (the heads matched to DIFF for it)
"""

from diffjax import recipes
from diffjax.config import Config


def get_config(arg: str = ""):
    size, arch, options = recipes.size_arch_options(arg, "configs/paper.py", default_size="1.4B")
    optim, data, train = recipes.paper_recipe(size)
    model = recipes.model_config(size, arch, **recipes.PAPER_SCALE, **options)
    return Config(model=model, data=data, optim=optim, train=train, name="-".join(["paper", size, arch,
                                                                                   *options.values()]))
