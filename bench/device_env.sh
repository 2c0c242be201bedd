# Sourced by the GPU-machine scripts in bench/: installs the pure-Python wheels the GPU machine lacks (gguf,
# opentelemetry, grpcio-health / reflection, ...), carried in .whl/ (and .whl_svc/), into /tmp/site once per machine,
# and puts them and the repository on PYTHONPATH. Without a .whl/ folder it does nothing but set the environment.
if [ -d .whl ] && [ ! -f /tmp/site/.specsplit_wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        $(ls .whl/*.whl .whl_svc/*.whl 2>/dev/null) || return 1
    touch /tmp/site/.specsplit_wheels
fi
if [ -d /tmp/site ]; then
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
