"""Experiments that reproduce the published DLC / DC-GRPO claims at small scale (`python -m experiments.dlc_repro`).

- `settings.py`: presets (tiny on CPU, Qwen3-0.6B / 1.7B on GPU) and the plan of runs;
- `runner.py`: one run, trainer step and vLLM sampler engine in lockstep, under controlled conditions;
- `engines.py`: the vLLM engines (one per precision, started once) and weight publishing (clean or noisy);
- `kl.py`: full-vocabulary KL to the on-policy runs on prefixes sampled from them (DESIGN section 6);
- `ess.py`: ESS crossings and the Gaussian (log-normal ratio) prediction;
- `report.py`: summary.csv, summary.md and the PNG plots.
"""
