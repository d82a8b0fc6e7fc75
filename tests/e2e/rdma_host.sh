#!/bin/sh
# Run a command on a simulated RDMA host: in this (private) mount namespace, rdma-core's
# user libraries unpacked under $1 are laid over /etc and the library directory with
# overlayfs, and ld.so.cache is remade, as installing Debian's packages would; the host
# itself is not changed. $2: an empty directory for overlayfs' upper layers.
set -e
root="$1"; work="$2"; shift 2
libdir=/usr/lib/x86_64-linux-gnu
mount -t tmpfs tmpfs "$work"
mkdir -p "$work/etc" "$work/etc.w" "$work/lib" "$work/lib.w"
mount -t overlay overlay -o "lowerdir=$root/etc:/etc,upperdir=$work/etc,workdir=$work/etc.w" /etc
mount -t overlay overlay -o "lowerdir=$root$libdir:$root/lib/x86_64-linux-gnu:$libdir,upperdir=$work/lib,workdir=$work/lib.w" "$libdir"
ldconfig
exec "$@"
