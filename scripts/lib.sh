# Shared by scripts/up and scripts/test: the system packages pgherd needs, installed when this
# runs as root on Debian or Ubuntu, named exactly otherwise. Sourced, not run.

step() { printf '\n=== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; }

# What building pgherd needs: pg_query and etcd-client generate bindings (libclang, clang's
# headers) and protobuf code (protoc, with the well-known .proto files of libprotobuf-dev); a C
# compiler builds PostgreSQL's parser.
BUILD_PACKAGES=(build-essential pkg-config clang libclang-dev protobuf-compiler libprotobuf-dev)
# PostgreSQL's server programs (initdb, pg_ctl, postgres, pg_basebackup, pg_rewind, pgbench) and
# psql: `pgherd up` runs its nodes with them.
POSTGRES_PACKAGES=(postgresql-15 postgresql-client-15)

# Installs the Debian packages given that are missing; safe to run again (it installs nothing
# when all are there). Not root: prints the exact command and fails.
ensure_debian_packages() {
    if ! command -v dpkg >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
        echo "This is not a Debian-like system, so nothing is installed. pgherd needs the" \
            "equivalents of these Debian packages: $*" >&2
        return 0
    fi
    local missing=() p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
            missing+=("$p")
    done
    if [ "${#missing[@]}" -eq 0 ]; then
        echo "Debian packages present: $*"
        return 0
    fi
    if [ "$(id -u)" -ne 0 ]; then
        echo "Missing Debian packages: ${missing[*]}" >&2
        echo "Install them (as root), then run this again:" >&2
        echo "    sudo apt-get install -y --no-install-recommends ${missing[*]}" >&2
        exit 2
    fi
    local p
    for p in "${missing[@]}"; do
        if [ "$p" = postgresql-15 ]; then
            # Debian's package would create and start a cluster of its own on port 5432;
            # pgherd and its tests make their own clusters.
            mkdir -p /etc/postgresql-common
            local conf=/etc/postgresql-common/createcluster.conf
            if [ -f "$conf" ] && grep -q '^[# ]*create_main_cluster' "$conf"; then
                sed -i 's/^[# ]*create_main_cluster.*/create_main_cluster = false/' "$conf"
            else
                echo "create_main_cluster = false" >>"$conf"
            fi
        fi
    done
    echo "Installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    # --force-confold: keep the createcluster.conf written above.
    apt-get install -y -q --no-install-recommends \
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "${missing[@]}"
}

# Puts cargo on PATH (rustup installs it in ~/.cargo); Debian's own Rust is too old for pgherd.
ensure_rust() {
    if ! command -v cargo >/dev/null 2>&1 && [ -f "$HOME/.cargo/env" ]; then
        # shellcheck disable=SC1091
        . "$HOME/.cargo/env"
    fi
    if ! command -v cargo >/dev/null 2>&1; then
        echo "cargo is missing: install Rust (stable, 1.85 or newer) with rustup, then run" \
            "this again." >&2
        exit 2
    fi
}

# cargo-deb builds pgherd's Debian package from crates/pgherd/Cargo.toml's [package.metadata.deb].
# Pinned: the package test relies on its command line.
CARGO_DEB_VERSION=3.8.0
ensure_cargo_deb() {
    if [ "$(cargo deb --version 2>/dev/null)" != "cargo-deb $CARGO_DEB_VERSION" ]; then
        echo "Installing cargo-deb $CARGO_DEB_VERSION"
        cargo install -q --locked --version "$CARGO_DEB_VERSION" cargo-deb
    fi
}
