# shellcheck shell=bash
# The fast network on a node (docs/network.md): what NCCL needs to leave plain sockets, looked
# for where the provider set a fabric up (CLOUDTRAIN_FABRIC: efa | infiniband |
# gpudirect-tcpx | gpudirect-tcpxo). Installs nothing: the cloud's image brings the drivers and
# the NCCL plugin (AWS Deep Learning AMI: EFA and aws-ofi-nccl; Azure HPC image: OFED and the
# topology files; GCP: the TCPX/TCPXO plugin and receive-datapath daemon from Google's recipe).
# What is missing is said, and NCCL then falls back to sockets (the preflight measures that).
#
# Sourced by node.sh (fabric_check), or run alone: bash fabric.sh KIND. Roots for tests:
# CLOUDTRAIN_SYSFS (default /sys), CLOUDTRAIN_FABRIC_PREFIX (default /, where the plugins are).

fabric_missing=""
fabric_found=""

fabric_note() { fabric_found="${fabric_found:+$fabric_found; }$*"; }
fabric_lack() { fabric_missing="${fabric_missing:+$fabric_missing; }$*"; }

# fabric_first DIR...: the first DIR (under the prefix) holding an NCCL net plugin
fabric_first() {
    local pre=${CLOUDTRAIN_FABRIC_PREFIX:-/} d
    for d in "$@"; do
        if ls "${pre%/}$d"/libnccl-net*.so* >/dev/null 2>&1; then echo "$d"; return 0; fi
    done
    return 1
}

fabric_devices() {  # the RDMA devices the kernel lists (EFA and InfiniBand both appear here)
    local sys=${CLOUDTRAIN_SYSFS:-/sys} d out=""
    for d in "$sys"/class/infiniband/*; do
        if [ -e "$d" ]; then out="$out ${d##*/}"; fi
    done
    echo "${out# }"
}

fabric_nics() {  # fabric_nics N: the GPU NICs eth1..ethN the recipe's settings name
    local sys=${CLOUDTRAIN_SYSFS:-/sys} i out="" gone=""
    for i in $(seq 1 "$1"); do
        if [ -e "$sys/class/net/eth$i" ]; then out="$out eth$i"; else gone="$gone eth$i"; fi
    done
    if [ -n "$out" ]; then fabric_note "GPU NICs:$out"; fi
    [ -z "$gone" ] || fabric_lack "no interface${gone} (the NCCL settings name eth1..eth$1)"
}

fabric_scan() {  # fabric_scan KIND: fills fabric_found / fabric_missing
    local kind=$1 devs plugin pre
    fabric_found="" fabric_missing=""
    devs=$(fabric_devices)
    case "$kind" in
    efa)
        if [ -n "$devs" ]; then fabric_note "EFA devices: $devs"
        else fabric_lack "no EFA device (is the EFA driver loaded? the Deep Learning AMI has it)"; fi
        if plugin=$(fabric_first /opt/amazon/ofi-nccl/lib /opt/amazon/ofi-nccl/lib64 \
                                 /opt/aws-ofi-nccl/lib /usr/local/lib); then
            fabric_note "aws-ofi-nccl in $plugin"
        else
            fabric_lack "no aws-ofi-nccl plugin (libnccl-net*.so): use the AWS Deep Learning AMI, or install aws-ofi-nccl"
        fi ;;
    infiniband)
        if [ -n "$devs" ]; then fabric_note "InfiniBand devices: $devs"
        else fabric_lack "no InfiniBand device (the Azure HPC image loads OFED)"; fi
        if [ -n "${NCCL_TOPO_FILE:-}" ]; then
            pre=${CLOUDTRAIN_FABRIC_PREFIX:-/}
            if [ -e "${pre%/}/${NCCL_TOPO_FILE#/}" ]; then
                fabric_note "topology $NCCL_TOPO_FILE"
            else
                fabric_lack "no $NCCL_TOPO_FILE (the HPC image has it)"
            fi
        fi ;;
    gpudirect-tcpx|gpudirect-tcpxo)
        fabric_nics "${CLOUDTRAIN_FABRIC_NICS:-4}"
        if plugin=$(fabric_first /usr/local/tcpx/lib64 /usr/local/tcpxo/lib64 \
                                 /var/lib/tcpx/lib64 /var/lib/tcpxo/lib64 /usr/local/nvidia/lib64); then
            fabric_note "GPUDirect NCCL plugin in $plugin"
        else
            fabric_lack "no GPUDirect NCCL plugin: run Google's $kind receive-datapath daemon and plugin containers (docs/network.md)"
        fi ;;
    *) fabric_lack "unknown fabric '$kind'" ;;
    esac
}

# fabric_check: node.sh's step (only where CLOUDTRAIN_FABRIC is set)
fabric_check() {
    [ -n "${CLOUDTRAIN_FABRIC:-}" ] || return 0
    step fabric
    fabric_scan "$CLOUDTRAIN_FABRIC"
    if [ -z "$fabric_missing" ]; then
        found "$CLOUDTRAIN_FABRIC: $fabric_found"
        result fabric "$CLOUDTRAIN_FABRIC ok"
    else
        skip "$CLOUDTRAIN_FABRIC incomplete, NCCL may fall back to sockets: $fabric_missing${fabric_found:+ (found: $fabric_found)}"
        result fabric "$CLOUDTRAIN_FABRIC missing: $fabric_missing"
    fi
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then   # run alone: one line, exit 1 when something is missing
    fabric_scan "${1:?usage: fabric.sh efa|infiniband|gpudirect-tcpx|gpudirect-tcpxo}"
    echo "found: ${fabric_found:-nothing}"
    [ -z "$fabric_missing" ] || { echo "missing: $fabric_missing"; exit 1; }
fi
