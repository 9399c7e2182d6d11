"""The paper's studies, read from finished sweeps: `ablation` (Table 6, from configs/ablation.py) and `scaling`
(Fig. 3, from configs/scaling.py). Each trains its sweep through `diffjax.sweep.run` and writes its tables and
figure into the sweep directory; `experiments/ablation.py` and `experiments/scaling.py` are their command lines."""
