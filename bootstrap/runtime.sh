# shellcheck shell=bash
# The host side of a task with `container:` (docs/containers.md), sourced by node.sh: the
# Docker Engine, the login user's access to it, and the NVIDIA Container Toolkit where a GPU
# is present. The image brings everything else; nothing of it is installed on the host.
# Uses node.sh's OS_NAME, PKG, GPUS and lib.sh's helpers. Sourced, never run.
#
# CLOUDTRAIN_DOCKER=check (local and ssh nodes, as for rclone): nothing is installed, started
# or changed; what is missing stops the step with the command that fixes it.
# Results: docker (the Engine's version), docker_sudo (1: this session reaches the Engine only
# through sudo; the login user is in group docker from its next login), container_toolkit (the
# toolkit's version, or empty without a GPU).

NVIDIA_CTK_BASE=${CLOUDTRAIN_NVIDIA_CTK_BASE:-https://nvidia.github.io/libnvidia-container}
DOCKER_DOCS="https://docs.docker.com/engine/install/"
CTK_DOCS="https://docs.nvidia.com/datacenter/cloud-native/container-toolkit/latest/install-guide.html"
DOCKER_MODE=${CLOUDTRAIN_DOCKER:-install}   # check: install and change nothing (local, ssh)

# engine_version [sudo]: the Engine's version, asked as this user, else (with "sudo", where
# passwordless sudo is there) through sudo; fails when it does not answer.
engine_version() {
    local v
    if v=$(docker version --format '{{.Server.Version}}' 2>/dev/null) && [ -n "$v" ]; then
        printf '%s\n' "$v"
        return 0
    fi
    { [ "${1:-}" = sudo ] && [ "$(id -u)" != 0 ] && sudo -n true 2>/dev/null; } || return 1
    v=$(sudo -n docker version --format '{{.Server.Version}}' 2>/dev/null) && [ -n "$v" ] \
        && printf '%s\n' "$v"
}

# docker_service start|restart: through systemd where it runs the system, else the init script.
docker_service() {
    if command -v systemctl >/dev/null 2>&1 && as_root systemctl "$1" docker >/dev/null 2>&1; then
        return 0
    fi
    command -v service >/dev/null 2>&1 || [ -x /usr/sbin/service ] || return 1
    as_root env PATH="$PATH:/usr/sbin:/sbin" service docker "$1" >/dev/null 2>&1
}

# wait_engine: up to 30 s for the Engine to answer (through sudo where needed).
wait_engine() {
    local i
    for i in $(seq 60); do
        if DOCKER_V=$(engine_version sudo); then return 0; fi
        [ "$i" = 60 ] || sleep 0.5
    done
    return 1
}

has_dockerd() {
    command -v dockerd >/dev/null 2>&1 || [ -x /usr/sbin/dockerd ] || [ -x /usr/bin/dockerd ]
}

# check_only WHAT FIX...: on a node cloudtrain does not change (local, ssh: CLOUDTRAIN_DOCKER
# =check), stop saying what is missing and how to get it; elsewhere carry on and install.
check_only() {
    [ "$DOCKER_MODE" = check ] || return 0
    local what=$1
    shift
    FAIL_CODE=7 fail "this task runs in a container and $what on this node; cloudtrain installs" \
        "nothing system-wide on a local or ssh node: $*, then run 'cloudtrain up' again."
}

docker_step() {
    step docker
    DOCKER_V="" DOCKER_SUDO=0
    local how="" note="" user
    user=$(id -un)
    # An Engine that answers is taken as it is (however it was installed: docker.io, Docker's
    # own packages, a snap); else docker.io where the CLI or the daemon is missing.
    if engine_version sudo >/dev/null; then
        :
    elif ! { docker --version >/dev/null 2>&1 && has_dockerd; }; then
        check_only "there is no Docker Engine" "install it ($DOCKER_DOCS; on Debian/Ubuntu" \
            "sudo apt-get install docker.io) and start it"
        [ "$PKG" = apt ] || FAIL_CODE=7 fail "this task runs in a container, and this node has no" \
            "Docker Engine; cloudtrain installs one only on Debian and Ubuntu (docker.io), not on" \
            "$OS_NAME. Install Docker Engine on the node ($DOCKER_DOCS), or use an image that has it."
        pkg_install docker.io
        how=installed
    fi
    if ! DOCKER_V=$(engine_version sudo); then
        check_only "the Docker Engine does not answer" "start it (sudo systemctl start docker)"
        { docker_service start && wait_engine; } || FAIL_CODE=7 fail "the Docker Engine on" \
            "this node does not start (neither 'systemctl start docker' nor 'service docker start' brought it up)." \
            "Look at its log on the node (journalctl -u docker, or /var/log/docker.log), fix it," \
            "then run 'cloudtrain up' again."
        [ -n "$how" ] || how=started
    fi
    if [ "$(id -u)" != 0 ] && ! engine_version >/dev/null; then
        # The socket belongs to group docker: the user joins it for the next logins; this
        # session (and a multiplexed SSH connection opened before) still needs sudo.
        if ! sudo -n true 2>/dev/null; then
            FAIL_CODE=7 fail "$user cannot use the Docker Engine on this node (not in group" \
                "docker) and has no passwordless sudo. Add it to the group (sudo usermod -aG" \
                "docker $user), log in again, then run 'cloudtrain up' again."
        fi
        if [ "$DOCKER_MODE" != check ] && ! id -nG "$user" 2>/dev/null | tr ' ' '\n' | grep -qx docker; then
            as_root env PATH="$PATH:/usr/sbin:/sbin" usermod -aG docker "$user"
            note="; $user added to group docker"
        fi
        DOCKER_SUDO=1
        note="$note; this session uses sudo for docker"
    fi
    case "$how" in
        installed) installed docker "Docker Engine $DOCKER_V (docker.io)$note" ;;
        started) installed docker "Docker Engine $DOCKER_V (was not running: started)$note" ;;
        *) found "Docker Engine $DOCKER_V$note" ;;
    esac
    result docker "$DOCKER_V"
    result docker_sudo "$DOCKER_SUDO"
}

# The Engine's runtimes include NVIDIA's (what nvidia-ctk configures for --gpus).
nvidia_runtime() {
    local r
    if [ "$DOCKER_SUDO" = 1 ]; then
        r=$(as_root docker info --format '{{json .Runtimes}}' 2>/dev/null) || return 1
    else
        r=$(docker info --format '{{json .Runtimes}}' 2>/dev/null) || return 1
    fi
    [[ "$r" == *'"nvidia"'* ]]
}

ctk_version() {
    nvidia-ctk --version 2>/dev/null | sed -n 's/.*version \([0-9][0-9.]*\).*/\1/p' | head -n1
}

# NVIDIA's libnvidia-container repository, for apt or dnf.
ctk_repo() {
    local tmp
    tmp=$(mktemp -d)
    case "$PKG" in
        apt)
            # apt reads an ASCII-armoured key named *.asc directly (no gpg needed)
            download "$NVIDIA_CTK_BASE/gpgkey" "$tmp/key.asc"
            as_root install -m 0644 "$tmp/key.asc" /usr/share/keyrings/nvidia-container-toolkit.asc
            # shellcheck disable=SC2016 # $(ARCH) is apt's, not the shell's
            printf 'deb [signed-by=/usr/share/keyrings/nvidia-container-toolkit.asc] %s/stable/deb/$(ARCH) /\n' \
                "$NVIDIA_CTK_BASE" > "$tmp/list"
            as_root install -m 0644 "$tmp/list" /etc/apt/sources.list.d/nvidia-container-toolkit.list
            # shellcheck disable=SC2034 # read by lib.sh's pkg_install
            APT_UPDATED=""
            ;;
        dnf)
            download "$NVIDIA_CTK_BASE/stable/rpm/nvidia-container-toolkit.repo" "$tmp/repo"
            as_root install -m 0644 "$tmp/repo" /etc/yum.repos.d/nvidia-container-toolkit.repo
            ;;
        *)
            rm -rf "$tmp"
            FAIL_CODE=7 fail "this node has ${GPUS}x $GPU_NAME and the task runs in a container," \
                "which needs the NVIDIA Container Toolkit; cloudtrain installs it on Ubuntu, Debian" \
                "and RHEL-family systems, not on $OS_NAME. Install it on the node ($CTK_DOCS)," \
                "or use an image that has it."
            ;;
    esac
    rm -rf "$tmp"
}

toolkit_step() {
    step container-toolkit
    CTK_V=""
    if [ "$GPUS" = 0 ]; then
        skip "no GPU"
    elif command -v nvidia-ctk >/dev/null 2>&1 && nvidia_runtime; then
        CTK_V=$(ctk_version)
        found "NVIDIA Container Toolkit ${CTK_V:-?} (Docker runtime 'nvidia')"
    else
        local did="was there"
        check_only "the Docker Engine has no 'nvidia' runtime (the NVIDIA Container Toolkit)" \
            "install the toolkit ($CTK_DOCS), run 'sudo nvidia-ctk runtime configure" \
            "--runtime=docker' and restart Docker"
        if ! command -v nvidia-ctk >/dev/null 2>&1; then
            ctk_repo
            pkg_install nvidia-container-toolkit
            did=""
        fi
        as_root nvidia-ctk runtime configure --runtime=docker >/dev/null
        if ! docker_service restart || ! wait_engine || ! nvidia_runtime; then
            FAIL_CODE=7 fail "the NVIDIA Container Toolkit is installed, but the Docker Engine does" \
                "not list the 'nvidia' runtime after a restart, so containers would not see the" \
                "GPUs. Check /etc/docker/daemon.json and restart Docker on the node" \
                "(sudo systemctl restart docker), then run 'cloudtrain up' again."
        fi
        CTK_V=$(ctk_version)
        installed container-toolkit "NVIDIA Container Toolkit ${CTK_V:-?}${did:+ ($did)}:" \
            "Docker runtime 'nvidia' registered"
    fi
    result container_toolkit "$CTK_V"
}
