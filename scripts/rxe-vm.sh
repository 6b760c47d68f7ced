#!/usr/bin/env bash
# rxe-vm.sh - run a command inside a throw-away QEMU VM with a soft-RoCE device
# (rdma_rxe "rxe0"), for the tests that need real verbs on a host whose kernel has
# no RDMA. The guest boots Debian's stock kernel (linux-image-amd64, fetched with
# apt-get download, never installed); its root is the host's / shared read-only
# over virtio-9p with a tmpfs overlay, and the current directory is shared
# read-write at the same path, so the host's venv and built extensions run as-is.
#
#   scripts/rxe-vm.sh 'cmd args...'     exit status = the command's; 125 = VM failure
#   scripts/rxe-vm.sh --deps            only install the apt packages (build needs verbs.h)
#
# Inside: RXEVM_GUEST=1 RXEVM_DEV=rxe0 RXEVM_IP=10.77.0.1 RXEVM_GID_INDEX=<RoCEv2 v4>.
# Knobs: RXEVM_WORK (cache, default /tmp/rdmamw-rxe-vm), RXEVM_TIMEOUT (s, 1500),
# RXEVM_MEM (MiB, 2048), RXEVM_CPUS (2), RXEVM_NO_APT=1 (never call apt-get).
# KVM is not used: on these hosts /dev/kvm cannot boot a stock kernel, so TCG.
set -euo pipefail

WORK=${RXEVM_WORK:-/tmp/rdmamw-rxe-vm}
TIMEOUT=${RXEVM_TIMEOUT:-1500}
MEM=${RXEVM_MEM:-2048}
CPUS=${RXEVM_CPUS:-2}
VERSION=2                       # bump to rebuild the cached initramfs
log() { echo "[rxe-vm] $*" >&2; }
die() { echo "[rxe-vm] ERROR: $*" >&2; exit 125; }
[ $# -ge 1 ] || { sed -n '2,15s/^# \{0,1\}//p' "$0" >&2; exit 2; }
[ "$(id -u)" = 0 ] || die "must run as root (apt, 9p export of /)"
mkdir -p "$WORK/runs"

# ---- packages: everything the VM and the device tests need, from apt
PKGS=(qemu-system-x86 busybox-static kmod cpio iproute2 xz-utils zstd
      rdma-core ibverbs-providers ibverbs-utils libibverbs-dev python3-pyverbs)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  [ "${RXEVM_NO_APT:-0}" = 1 ] && die "missing packages: ${missing[*]}"
  log "apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >"$WORK/apt.log" 2>&1 || { tail -20 "$WORK/apt.log" >&2; die "apt-get update failed"; }
  apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$WORK/apt.log" 2>&1 \
    || { tail -30 "$WORK/apt.log" >&2; die "apt-get install failed"; }
fi

[ "$1" = --deps ] && exit 0

# ---- kernel: the ABI linux-image-amd64 points at, unpacked into the cache
exec 9>"$WORK/.lock"
flock 9
if [ ! -s "$WORK/kver" ]; then
  kv() { apt-cache depends linux-image-amd64 2>/dev/null | sed -n 's/^ *Depends: linux-image-\([0-9].*-amd64\)$/\1/p' | head -1; }
  KVER=$(kv)
  [ -n "$KVER" ] || { apt-get update -q >/dev/null 2>&1 || true; KVER=$(kv); }
  [ -n "$KVER" ] || die "cannot resolve linux-image-amd64 to a kernel version"
  echo "$KVER" >"$WORK/kver"
fi
KVER=$(cat "$WORK/kver")
KDIR="$WORK/kernel-$KVER"
if [ ! -f "$KDIR/lib/modules/$KVER/modules.dep" ]; then
  log "fetching linux-image-$KVER"
  rm -rf "$WORK/debs" "$KDIR.tmp"; mkdir -p "$WORK/debs" "$KDIR.tmp"
  (cd "$WORK/debs" && apt-get download "linux-image-$KVER" >"$WORK/kernel.log" 2>&1) \
    || { cat "$WORK/kernel.log" >&2; die "apt-get download linux-image-$KVER failed"; }
  dpkg -x "$WORK"/debs/linux-image-*.deb "$KDIR.tmp"
  depmod -b "$KDIR.tmp" "$KVER"
  rm -rf "$KDIR" "$WORK/debs"; mv "$KDIR.tmp" "$KDIR"
fi
BOOT="$KDIR/boot/vmlinuz-$KVER"
# The ELF inside the bzImage boots through its PVH entry: no SeaBIOS and no in-guest
# decompression, about 4 s less per boot under TCG.
if [ ! -f "$KDIR/vmlinux.pvh" ] && [ ! -f "$KDIR/vmlinux.nopvh" ]; then
  python3 "$(dirname "$0")/extract_vmlinux.py" "$BOOT" "$KDIR/vmlinux.pvh" 2>/dev/null \
    || touch "$KDIR/vmlinux.nopvh"
fi
[ -f "$KDIR/vmlinux.pvh" ] && BOOT="$KDIR/vmlinux.pvh"

# ---- initramfs: busybox + the modules needed to mount 9p and overlay
INITRD="$WORK/initramfs-$KVER-v$VERSION.gz"
if [ ! -f "$INITRD" ]; then
  B="$WORK/initramfs"; rm -rf "$B"; mkdir -p "$B"/{bin,modules,proc,sys,dev,lower,upper,newroot,results}
  cp /bin/busybox "$B/bin/busybox"
  modprobe -d "$KDIR" -S "$KVER" -a --show-depends virtio_pci 9pnet_virtio 9p overlay virtio_rng \
    | awk '$1=="insmod"{print $2}' | awk '!seen[$0]++' | while read -r ko; do
      base=$(basename "$ko"); base=${base%.xz}; base=${base%.zst}
      case "$ko" in *.xz) xz -dc "$ko" ;; *.zst) zstd -dqc "$ko" ;; *) cat "$ko" ;; esac >"$B/modules/$base"
      echo "$base" >>"$B/modules.list"
    done
  cat >"$B/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc; mount -t sysfs sysfs /sys; mount -t devtmpfs devtmpfs /dev
fatal() { echo "rxe-vm init: $*"; echo o >/proc/sysrq-trigger; sleep 30; }
for m in $(cat /modules.list); do insmod /modules/$m; done
O=trans=virtio,version=9p2000.L,msize=262144
mount -t 9p -o $O results /results || fatal "mount results"
. /results/boot.conf
mount -t 9p -o $O,ro,cache=loose hostroot /lower || fatal "mount hostroot"
mount -t tmpfs -o mode=755 tmpfs /upper; mkdir -p /upper/u /upper/w
mount -t overlay overlay -o lowerdir=/lower,upperdir=/upper/u,workdir=/upper/w /newroot || fatal overlay
mkdir -p "/newroot$RES" && mount --move /results "/newroot$RES" || fatal "move results"
mkdir -p "/newroot$CWD" && mount -t 9p -o $O cwd "/newroot$CWD" || fatal "mount cwd"
K=$(uname -r)
mkdir -p "/newroot/lib/modules/$K" && mount --bind "/newroot$MODDIR" "/newroot/lib/modules/$K"
for d in proc sys dev; do mount --move /$d /newroot/$d; done
exec switch_root /newroot /bin/bash "$RES/stage2.sh"
INIT
  chmod +x "$B/init"
  (cd "$B" && find . | cpio -o -H newc --quiet | gzip -1) >"$INITRD.tmp" && mv "$INITRD.tmp" "$INITRD"
  rm -rf "$B"
fi
flock -u 9

# ---- the run: boot config, environment, command, guest stage 2
RES=$(mktemp -d "$WORK/runs/run.XXXXXX"); chmod 755 "$RES"
CWD=$(pwd -P)
[ "$CWD" != / ] || die "run it from a project folder, not /"
printf 'RES=%q\nCWD=%q\nMODDIR=%q\n' "$RES" "$CWD" "$KDIR/lib/modules/$KVER" >"$RES/boot.conf"
while IFS= read -r -d '' kv; do
  n=${kv%%=*}
  [[ $n =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || continue
  case $n in PWD|OLDPWD|SHLVL|_|HOSTNAME|BASH_*|SSH_*|TERM|DISPLAY) continue ;; esac
  printf 'export %s=%q\n' "$n" "${kv#*=}"
done < <(env -0) >"$RES/env.sh"
if [ $# -eq 1 ]; then printf '%s\n' "$1" >"$RES/cmd.sh"; else { printf 'exec'; printf ' %q' "$@"; echo; } >"$RES/cmd.sh"; fi
cat >"$RES/stage2.sh" <<'STAGE2'
RES=$(dirname "$BASH_SOURCE"); . "$RES/boot.conf"
read -r up _ </proc/uptime; echo "stage2 $up" >>"$RES/timings"
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
trap 'sync; echo o >/proc/sysrq-trigger; sleep 30' EXIT
mount -t tmpfs tmpfs /run; mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts; mount -t tmpfs -o mode=1777 tmpfs /dev/shm
ln -sf /proc/self/fd /dev/fd
hostname rxe-vm; ulimit -l unlimited; ip link set lo up
(
  PS4="+ \$(cut -d\" \" -f1 /proc/uptime) "; set -x
  modprobe -a rdma_rxe ib_uverbs && modprobe dummy numdummies=0 &&
  ip link add dummy0 type dummy && ip link set dummy0 up && ip addr add 10.77.0.1/24 dev dummy0 &&
  rdma link add rxe0 type rxe netdev dummy0
) >"$RES/setup.log" 2>&1 || { echo 125 >"$RES/rc"; exit 1; }
GIDX=
for i in $(seq 100); do   # the RoCE v2 IPv4-mapped GID appears a moment after the link
  for n in 0 1 2 3 4 5 6 7; do
    read -r g <"/sys/class/infiniband/rxe0/ports/1/gids/$n" 2>/dev/null || continue
    read -r t <"/sys/class/infiniband/rxe0/ports/1/gid_attrs/types/$n" 2>/dev/null || continue
    case $g in 0000:0000:0000:0000:0000:ffff:*) [ "$t" = "RoCE v2" ] && { GIDX=$n; break; } ;; esac
  done
  [ -n "$GIDX" ] && break; sleep 0.1
done
read -r up _ </proc/uptime; echo "rxe_ready $up" >>"$RES/timings"
cd "$CWD"
( . "$RES/env.sh"
  export RXEVM_GUEST=1 RXEVM_DEV=rxe0 RXEVM_IP=10.77.0.1 RXEVM_GID_INDEX=${GIDX:-1}
  exec /bin/bash "$RES/cmd.sh" ) >"$RES/output.log" 2>&1 </dev/null
echo $? >"$RES/rc"
STAGE2

log "booting $KVER under TCG ($CPUS vCPU, $MEM MiB); run dir $RES"
t0=$(date +%s)
set +e
timeout -k 10 "$TIMEOUT" qemu-system-x86_64 -accel tcg,thread=multi -cpu max -smp "$CPUS" -m "$MEM" \
  -nodefaults -no-user-config -display none -no-reboot -serial "file:$RES/console.log" \
  -kernel "$BOOT" -initrd "$INITRD" \
  -append "console=ttyS0 panic=-1 sysrq_always_enabled=1 quiet loglevel=4 rdinit=/init" \
  -virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap" \
  -virtfs "local,path=$RES,mount_tag=results,security_model=none,multidevs=remap" \
  -virtfs "local,path=$CWD,mount_tag=cwd,security_model=none,multidevs=remap" \
  -device virtio-rng-pci </dev/null >"$RES/qemu.log" 2>&1 &
qpid=$!
tail -n +1 -F --pid=$qpid "$RES/output.log" 2>/dev/null &
tpid=$!
wait $qpid; qrc=$?
sleep 0.3; kill $tpid 2>/dev/null; wait $tpid 2>/dev/null
set -e
log "VM ran $(( $(date +%s) - t0 )) s"
if [ -f "$RES/rc" ]; then
  rc=$(cat "$RES/rc")
  if [ "$rc" = 125 ] || [ "${RXEVM_KEEP:-0}" = 1 ]; then cat "$RES/setup.log" >&2; log "run dir kept: $RES"; else rm -rf "$RES"; fi
  exit "$rc"
fi
log "no exit status came back (qemu rc=$qrc); console tail:"
tail -30 "$RES/console.log" >&2 || true
tail -5 "$RES/qemu.log" >&2 || true
log "run dir kept: $RES"
exit 125
