# Sourced by the device scripts (run from the repository root on the GPU machine): installs the carried
# wheels (.whl: trl, datasets, bitsandbytes, liger, ...; .whl-ds: DeepSpeed and its dependencies; .whl-ao,
# when carried: torchao 0.17.0, the release built for torch 2.11, for the FP8 benchmark) into /tmp/site,
# which that machine lacks, and puts the checkout and /tmp/site on PYTHONPATH.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
# a wheel folder not carried is left out (the carried paths must stay under 64 MiB in all)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl .whl-ds/*.whl \
  .whl-ao/*.whl 2>/dev/null) 2>&1 | tail -2
export PYTHONPATH=$PWD/src:$PWD:/tmp/site
# stock TRL 1.12 (the PPO baseline) in its own folder, never next to trl 1.16, when .whl-trl112 is carried
if [ -d .whl-trl112 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site112 .whl-trl112/*.whl \
    .whl/datasets* .whl/dill* .whl/multiprocess* 2>&1 | tail -2
  export TRL112_PATH=/tmp/site112
fi
