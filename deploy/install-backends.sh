#!/usr/bin/env bash
# Install the real Prometheus, promtool, Alertmanager (with amtool) and VictoriaMetrics binaries
# that the end-to-end and configuration tests run. They come from Debian trixie's packages,
# fetched with a private apt configuration (the system's sources and lists are left untouched)
# and unpacked with dpkg -x.
#
# Usage: deploy/install-backends.sh [DEST]     (default: .cache/backends in the repository)
# Prints nothing but progress; the binaries end up in DEST/bin. Idempotent.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-${RANKWATCH_BACKENDS_DIR:-$repo/.cache/backends}}
suite=${RANKWATCH_BACKENDS_SUITE:-trixie}
mirror=${RANKWATCH_BACKENDS_MIRROR:-http://deb.debian.org/debian}
packages=(prometheus promtool prometheus-alertmanager victoria-metrics)
bins=(prometheus promtool prometheus-alertmanager amtool victoria-metrics)

mkdir -p "$dest/bin"
have_all=1
for b in "${bins[@]}"; do [ -x "$dest/bin/$b" ] || have_all=0; done
[ -f /usr/share/prometheus/alertmanager/default.tmpl ] || have_all=0
if [ "$have_all" = 1 ]; then
    echo "backends already installed in $dest/bin"
    exit 0
fi

work="$dest/apt"
mkdir -p "$work/lists/partial" "$work/archives/partial" "$work/root"
echo "deb $mirror $suite main" > "$work/sources.list"
apt_opts=(
    -o "Dir::Etc::SourceList=$work/sources.list"
    -o "Dir::Etc::SourceParts=/dev/null"
    -o "Dir::State::Lists=$work/lists"
    -o "Dir::Cache::Archives=$work/archives"
    -o "APT::Sandbox::User=root"
    -o "Debug::NoLocking=1"
)
echo "fetching ${packages[*]} from $suite"
apt-get -qq "${apt_opts[@]}" update
(cd "$work" && apt-get -qq "${apt_opts[@]}" download "${packages[@]}")
for deb in "$work"/*.deb; do
    dpkg -x "$deb" "$work/root"
done
# Debian ships the binaries under /usr/bin (amtool comes with prometheus-alertmanager);
# VictoriaMetrics' single-node server is victoria-metrics.
for b in "${bins[@]}"; do
    src="$work/root/usr/bin/$b"
    [ -x "$src" ] || { echo "missing $b in the unpacked packages" >&2; exit 1; }
    cp "$src" "$dest/bin/$b"
done
# Alertmanager is called prometheus-alertmanager in Debian; give it its upstream name too.
ln -sf prometheus-alertmanager "$dest/bin/alertmanager"
# Debian's Alertmanager reads its notification templates from a fixed path instead of the
# copy upstream embeds; it refuses to start without them. Keep a copy and put them there.
tmpl_src="$work/root/usr/share/prometheus/alertmanager"
mkdir -p "$dest/share/alertmanager"
cp "$tmpl_src"/*.tmpl "$dest/share/alertmanager/"
if [ ! -f /usr/share/prometheus/alertmanager/default.tmpl ]; then
    mkdir -p /usr/share/prometheus/alertmanager
    cp "$tmpl_src"/*.tmpl /usr/share/prometheus/alertmanager/
fi
rm -rf "$work/root" "$work"/*.deb
for b in "${bins[@]}"; do
    echo "installed $dest/bin/$b"
done
