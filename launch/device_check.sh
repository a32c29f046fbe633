#!/usr/bin/env bash
# Container entrypoint: fail at start when JAX sees no GPU (a build has none to check), then run
# the command. RSTAR_JAX_ALLOW_CPU=1 skips the check (CPU smoke tests of the image).
set -euo pipefail
if [[ "${RSTAR_JAX_ALLOW_CPU:-0}" != 1 ]]; then
  python -c "
import jax, sys
devices = jax.devices()
if devices[0].platform != 'gpu':
    sys.exit(f'no GPU visible to JAX ({devices}); pass --device=/dev/kfd --device=/dev/dri, or RSTAR_JAX_ALLOW_CPU=1')
print(f'{len(devices)} x {devices[0].device_kind}', file=sys.stderr)"
fi
exec "$@"
