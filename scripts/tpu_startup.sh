#!/bin/bash
# The start-up script of a slice that scripts/tpu_queued.sh creates: Compute Engine runs it as root on every worker at
# every boot (the `startup-script` metadata key), so a slice recreated after a Spot preemption installs diffjax and
# resumes the run by itself. tpu_queued.sh puts the settings below in front of it; to try it by hand on a worker:
#   sudo SOURCE=gs://b/diffjax.tar.gz RUN=gs://b/runs/x DATA=/mnt/shared/shards bash tpu_startup.sh
set -euo pipefail

: "${SOURCE:?set SOURCE to a gs:// URL of the checkout as a tarball (git archive -o diffjax.tar.gz HEAD)}"
: "${RUN:?set RUN to the run directory}" "${DATA:?set DATA to the prepared shards}"
CONFIG=${CONFIG:-configs/paper.py:size=1.4B,arch=diff}
TOKENIZER=${TOKENIZER:-cl100k_base}
NFS=${NFS:-}  # HOST:/share to mount at /mnt/shared (a Filestore share), or empty
APP=${APP:-/opt/diffjax}  # the checkout and its venv
LOG=${LOG:-/var/log/diffjax-train.log}  # this worker's log

apt=(apt-get -o DPkg::Lock::Timeout=600)  # a fresh VM's unattended upgrades hold dpkg's lock for a while
if [[ -n $NFS ]] && ! mountpoint -q /mnt/shared; then
    "${apt[@]}" install -y nfs-common
    mkdir -p /mnt/shared
    mount -t nfs "$NFS" /mnt/shared
fi
if [[ ! -x $APP/.venv/bin/diffjax ]]; then  # a fresh worker (a recreated slice is one): Python 3.11 and the checkout
    add-apt-repository -y ppa:deadsnakes/ppa
    "${apt[@]}" update
    "${apt[@]}" install -y python3.11 python3.11-venv
    mkdir -p "$APP"
    gcloud storage cp "$SOURCE" /tmp/diffjax.tar.gz
    tar -xzf /tmp/diffjax.tar.gz -C "$APP"
    python3.11 -m venv "$APP/.venv"
    "$APP/.venv/bin/pip" install -q --upgrade pip
    "$APP/.venv/bin/pip" install -q -e "${APP}[tpu]"
fi

command=("$APP/.venv/bin/diffjax" train --config "$CONFIG" --workdir "$RUN" --no-progress --distributed
         --set mesh.data=1 --set mesh.fsdp=-1
         --set data.source=shards --set data.path="$DATA" --set data.tokenizer="$TOKENIZER")
train=$(printf '%q ' "${command[@]}")
if [[ $RUN != *://* ]]; then  # a mounted run directory: each worker's log beside the run too
    mkdir -p "$RUN/logs"
    train="${train}2>&1 | tee -a $(printf '%q' "$RUN/logs/$(hostname).log")"
fi
# A unit of its own, outside the start-up script's, which systemd ends when the script does; a second boot's
# launch while the run is alive fails on the unit name, and the run's lock refuses a second trainer anyway.
systemd-run --unit=diffjax-train --collect --working-directory="$APP" /bin/bash -c "($train) >> $LOG 2>&1 < /dev/null"
