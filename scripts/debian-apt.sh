#!/usr/bin/env bash
# Run apt-get against a private apt configuration that adds suites this
# host's own apt does not carry (trixie sources, bookworm-backports
# binaries), without touching the system configuration.
#
# The mirror is whatever this machine's apt already uses: it is read from
# /etc/apt at run time, so no registry host name is written anywhere.
#
# Usage: debian-apt.sh update
#        debian-apt.sh source PKG[=VER]       (unpacks into $PWD)
#        debian-apt.sh download PKG[=VER]...  (into $PWD)
#        debian-apt.sh policy PKG
#        debian-apt.sh mirror                 (prints the Debian mirror's URI)
set -euo pipefail

cache=${THINVM_CACHE:-$HOME/.cache/thinvm}
root=$cache/apt

mirror_uri() {
	local uri=""
	if [ -f /etc/apt/sources.list.d/debian.sources ]; then
		uri=$(awk '/^URIs:/ { print $2; exit }' /etc/apt/sources.list.d/debian.sources)
	fi
	if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
		uri=$(awk '$1 == "deb" && $0 !~ /security/ { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { print $i; exit } }' \
			/etc/apt/sources.list)
	fi
	if [ -z "$uri" ]; then
		echo "debian-apt: cannot find the Debian mirror in /etc/apt" >&2
		exit 1
	fi
	echo "$uri"
}

# Replaces $1 with stdin through a rename, and only when the text changed:
# several callers run at once (parallel tests each build an image), and one
# truncating sources.list while another's apt-cache reads it made that
# reader see no suites at all.
install_text() {
	local file=$1 new
	new=$(mktemp "$file.XXXXXX")
	cat >"$new"
	if cmp -s "$new" "$file"; then
		rm -f "$new"
	else
		mv -f "$new" "$file"
	fi
}

write_config() {
	local uri keyring=/usr/share/keyrings/debian-archive-keyring.gpg
	uri=$(mirror_uri)
	mkdir -p "$root/lists/partial" "$root/archives/partial" "$root/etc/preferences.d"
	install_text "$root/etc/sources.list" <<SRC
deb-src [signed-by=$keyring] $uri trixie main
deb [signed-by=$keyring] $uri bookworm main
deb [signed-by=$keyring] $uri bookworm-backports main
SRC
	install_text "$root/etc/apt.conf" <<CONF
Dir::Etc::SourceList "$root/etc/sources.list";
Dir::Etc::SourceParts "/nonexistent";
Dir::Etc::PreferencesParts "$root/etc/preferences.d";
Dir::State::Lists "$root/lists";
Dir::State::Status "/var/lib/dpkg/status";
Dir::Cache "$root";
Dir::Cache::Archives "$root/archives";
APT::Sandbox::User "root";
Acquire::Languages "none";
CONF
}

# An update rewrites the lists under every query: updates hold this lock
# exclusively, queries share it.  A second update waits for the first and
# then finds the lists fresh, instead of failing on apt's own lock and
# going on with lists half replaced.
lock_lists() {
	exec 9>"$root/.lock"
	flock "$1" 9
}

if [ "${1:-}" = mirror ]; then
	mirror_uri
	exit 0
fi
write_config
export APT_CONFIG=$root/etc/apt.conf
# apt's binary package caches, named on the command line because a host
# may turn them off in apt.conf.d (Debian's container images do, with
# docker-clean), which is read after APT_CONFIG: without them every query
# parses the lists anew, ~1 s of CPU, and the test suite makes dozens.
caches=(-o "Dir::Cache::pkgcache=$root/pkgcache.bin"
	-o "Dir::Cache::srcpkgcache=$root/srcpkgcache.bin")
case "${1:-}" in
update)
	# Lists older than a day are refreshed; otherwise this is a no-op.
	lock_lists --exclusive
	stamp=$root/lists/.stamp
	if [ -z "$(find "$stamp" -mmin -1440 2>/dev/null)" ]; then
		apt-get -q "${caches[@]}" update >&2
		touch "$stamp"
	fi
	;;
source)
	shift
	lock_lists --shared
	apt-get -q "${caches[@]}" --download-only source "$@" >&2
	;;
download)
	shift
	lock_lists --shared
	apt-get -q "${caches[@]}" download "$@" >&2
	;;
policy|show|madison)
	cmd=$1
	shift
	lock_lists --shared
	apt-cache "${caches[@]}" "$cmd" "$@"
	;;
*)
	echo "usage: $0 update|source|download|policy|mirror ..." >&2
	exit 2
	;;
esac
