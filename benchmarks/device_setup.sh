# What a lent GPU machine needs to run this project's device scripts (benchmarks/gpu.py, benchmarks/depth.py).
# Its image has Python 3.12 with torch, accelerate, tokenizers and transformers 5.17, and no network; the package
# needs transformers 5.23 or newer, so that travels as a wheel.
#
#   bash benchmarks/device_setup.sh download   # here, once: the wheels into .whl/ (git-ignored), about 14 MB
#   source benchmarks/device_setup.sh          # there, first in each command that carries .whl: the wheels and this
#                                              # checkout's package into /tmp/site, which goes on PYTHONPATH
#
# The package is copied in its installed layout (modeling/ as hf_hyperdflash/modeling), not built: the image's
# setuptools may predate the one pyproject.toml asks for. Then, for example:
#   source benchmarks/device_setup.sh && python benchmarks/depth.py --stages target --copy-to $OUT
# Checked on CPU under Python 3.12 with transformers 5.17 and no ShareGPT package (a venv built to match the image):
# `python benchmarks/depth.py --device cpu --smoke`, its data made beforehand, ran every other stage.

DEVICE_WHEELS=(transformers==5.24.0 regex)  # transformers 5.24 checks at import for regex>=2025.10.22

if [ "${1:-}" = download ]; then
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${DEVICE_WHEELS[@]}" && ls -l .whl
else
    python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl \
        && cp -r hf_hyperdflash /tmp/site/ \
        && cp -r modeling/. /tmp/site/hf_hyperdflash/modeling/ \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} \
        && python3 -P -c "import transformers, hf_hyperdflash; print('device set up: transformers', transformers.__version__)"
fi
