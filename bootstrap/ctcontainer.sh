#!/usr/bin/env bash
# The node's long-lived container (docs/containers.md): one per node and cluster, the user's
# image untouched, jobs run in it with 'docker exec' from the host.
#
#   ctcontainer.sh ensure ROOT NAME SPEC REQ DIGEST GPUS IMAGE_ID CLUSTER CLUSTER_ID RANK \
#                  MOUNTS -- [RUN_OPTION...]
#       The container NAME runs IMAGE_ID with the labels of its cluster and SPEC: reused when
#       it runs with the same SPEC label, else replaced (rm -f, run again). MOUNTS: absolute
#       paths (':'-separated, may be empty) bind-mounted at the same path, besides $HOME and
#       ROOT. Writes ROOT/.container "NAME REQ KEEPER_PID KEEPER_START DIGEST UID:GID SHELL
#       API" (what the next launch's prep compares, and each job's docker exec reads, with
#       bash builtins only) and prints
#       "::container started|reused NAME ID". Exit 3: no docker; 4: GPUs but no NVIDIA
#       Container Toolkit; 5: the container did not stay up.
#   ctcontainer.sh exec KEEPER_PID API DOCKER_EXEC_ARGS...
#       'docker exec DOCKER_EXEC_ARGS' that ends when the container does: with a host PID
#       namespace, a docker exec client whose container was removed under it never returns, so
#       a watcher ends it once the keeper (KEEPER_PID, may be empty) is gone. API: the
#       Engine's API version (empty or '-': the client asks). Exits with the command's code.
#   ctcontainer.sh remove CLUSTER_ID
#       Remove every container labelled cloudtrain-cluster-id=CLUSTER_ID; prints "::left N"
#       (how many are still there: 0 when clean). Nothing else of docker's is touched.
set -u

ensure() {
    local root=$1 name=$2 spec=$3 req=$4 digest=$5 gpus=$6 image=$7 cluster=$8 cid=$9
    local rank=${10} mounts=${11}
    shift 12
    local now id pid start t d lock
    if ! command -v docker >/dev/null 2>&1; then
        echo "::container no-docker" >&2
        exit 3
    fi
    if [ "$gpus" -gt 0 ] && ! docker info --format '{{range $k, $v := .Runtimes}}{{$k}} {{end}}' \
            2>/dev/null | grep -qw nvidia && ! command -v nvidia-container-cli >/dev/null 2>&1; then
        echo "::container no-nvidia-toolkit" >&2
        exit 4
    fi
    now=$(docker inspect -f '{{.State.Running}} {{index .Config.Labels "cloudtrain-spec"}}' \
        "$name" 2>/dev/null)
    if [ "$now" = "true $spec" ]; then
        how=reused
    else
        how=started
        docker rm -f "$name" >/dev/null 2>&1
        rm -f "$root/.setup-hash"   # the setup ran in the old container: run it again
        local args=(-d -i --rm --name "$name" --network host --pid host
                    --label "cloudtrain-cluster=$cluster" --label "cloudtrain-cluster-id=$cid"
                    --label "cloudtrain-node-rank=$rank" --label "cloudtrain-spec=$spec"
                    -u "$(id -u):$(id -g)" -e "CLOUDTRAIN_CLUSTER_ID=$cid"
                    -e HOME -e USER -e LOGNAME)
        # The SSH user's other groups (device access such as video, render): docker exec
        # processes get the container's, and '-u UID:GID' alone would drop them.
        for g in $(id -G); do [ "$g" = "$(id -g)" ] || args+=(--group-add "$g"); done
        # The session's own CLOUDTRAIN_* markers (a provider's, e.g. local nodes') go in too:
        # whatever finds the session's processes by them finds the keeper and the jobs.
        for v in $(compgen -e); do
            case $v in CLOUDTRAIN_CLUSTER_ID) ;; CLOUDTRAIN_*) args+=(-e "$v") ;; esac
        done
        # Locked memory: as much as this host allows (unlimited where the daemon may).
        t=$(ulimit -H -l)
        if [ "$t" = unlimited ]; then args+=(--ulimit memlock=-1:-1)
        else args+=(--ulimit "memlock=$((t * 1024)):$((t * 1024))"); fi
        # Shared memory for DataLoader workers: the host's, unless the task chose.
        case " $* " in *" --ipc"*|*" --shm-size"*) ;; *) args+=(--ipc host) ;; esac
        [ "$gpus" -gt 0 ] && args+=(--gpus all)
        # The fast network: InfiniBand and EFA verbs devices, where the host has them.
        for d in /dev/infiniband/*; do [ -c "$d" ] && args+=(--device "$d"); done
        args+=(-v "$HOME:$HOME")
        case $root in /*) case $root/ in "$HOME"/*) ;; *) args+=(-v "$root:$root") ;; esac ;; esac
        IFS=: read -r -a extra <<< "$mounts"
        for t in "${extra[@]}"; do
            [ -n "$t" ] || continue
            [ -e "$t" ] || mkdir -p "$t"
            args+=(-v "$t:$t")
        done
        # The keeper is a shell reading a stdin that stays open (-i): it needs nothing of the
        # image but /bin/sh, and ends (the container with it, --rm) when it is signalled.
        docker run "${args[@]}" "$@" --entrypoint /bin/sh "$image" -c 'read -r _' >/dev/null \
            || exit $?
    fi
    id=$(docker inspect -f '{{.State.Running}} {{.State.Pid}} {{.Id}}' "$name" 2>/dev/null)
    read -r running pid id <<< "$id"
    if [ "${running:-}" != true ] || [ "${pid:-0}" = 0 ]; then
        echo "::container not-up $name" >&2
        exit 5
    fi
    start=$(cut -d')' -f2- "/proc/$pid/stat" | awk '{print $20}')
    # What each job's docker exec needs, found once here: the user, the image's shell (bash
    # where it has one) and the Engine's API version (the client then skips its ping).
    shell="sh"
    docker exec "$name" /bin/sh -c 'command -v bash' >/dev/null 2>&1 && shell="bash"
    api=$(docker version --format '{{.Server.APIVersion}}' 2>/dev/null)
    lock="$root/.container.tmp"
    echo "$name $req $pid $start $digest $(id -u):$(id -g) $shell ${api:--}" > "$lock" \
        && mv "$lock" "$root/.container"
    echo "::container $how $name $id"
}

exec_() {
    local keeper=$1 c w rc
    case ${2:-} in ''|-) ;; *) export DOCKER_API_VERSION=$2 ;; esac
    shift 2
    if [ -n "$keeper" ] && [ ! -e "/proc/$keeper" ]; then
        echo "cloudtrain: this node's container is not running (stopped, or removed by hand):" \
             "launch the task again to start it" >&2
        exit 125
    fi
    docker exec "$@" < /dev/null &
    c=$!
    if [ -n "$keeper" ]; then
        { while [ -e "/proc/$keeper" ] && kill -0 "$c" 2>/dev/null; do sleep 1; done
          if kill -0 "$c" 2>/dev/null; then
              echo "cloudtrain: the container ended under the job" >&2
              kill "$c" 2>/dev/null
          fi; } &
        w=$!
    fi
    trap ':' TERM INT HUP
    while kill -0 "$c" 2>/dev/null; do wait "$c"; done
    wait "$c"
    rc=$?
    [ -n "${w:-}" ] && kill "$w" 2>/dev/null
    exit "$rc"
}

remove() {
    local ids
    command -v docker >/dev/null 2>&1 || { echo "::left 0"; return 0; }
    ids=$(docker ps -aq --filter "label=cloudtrain-cluster-id=$1" 2>/dev/null)
    # shellcheck disable=SC2086  # container ids: one word each
    [ -n "$ids" ] && docker rm -f $ids >/dev/null 2>&1
    echo "::left $(docker ps -aq --filter "label=cloudtrain-cluster-id=$1" 2>/dev/null | wc -l)"
}

mode=${1:-}
shift || true
case $mode in
    ensure) ensure "$@" ;;
    exec) exec_ "$@" ;;
    remove) remove "$@" ;;
    *) echo "usage: ctcontainer.sh ensure|exec|remove ..." >&2; exit 2 ;;
esac
