#!/usr/bin/env bash
# rxe-vm.sh — run host-built binaries against a real verbs device (soft-RoCE,
# the kernel's rdma_rxe driver) inside a QEMU guest, for hosts whose kernel
# has no RDMA (containers, CI machines).
#
# Usage (as root):
#   scripts/rxe-vm.sh BIN[::ARGS] [BIN[::ARGS]...]
#
# Every BIN (built on this host: Debian 12 / glibc, dynamically linked) is
# copied into the guest and run there, one after the other, with
#   FERRY_VERBS_URL=verbs://rxe0   RUST_BACKTRACE=0   $RXE_VM_ENV
# and the arguments after `::` (e.g. `target/release/ferry::bench --backend
# verbs://rxe0`), else those in $RXE_VM_ARGS (e.g. "--test-threads=1"). The guest
# loads rdma_rxe, creates rxe0 on a dummy network interface (no NIC: all
# RoCE traffic stays inside the guest kernel), and powers off when the last
# binary is done. The script exits 0 only if every binary exited 0.
#
# Environment:
#   RXE_VM_DIR          work directory (guest root filesystem, logs);
#                       default /var/tmp/ferry-rxe-vm. Built once
#                       (debootstrap + apt, about a minute), reused after.
#   RXE_VM_ARGS         arguments for every binary (default: none)
#   RXE_VM_ENV          extra KEY=VALUE words for the guest environment
#   RXE_VM_BIN_TIMEOUT  seconds one binary may run (default 1800)
#   RXE_VM_SMP          guest vCPUs (default 2); RXE_VM_MEM MiB (default 2048)
#
# How: QEMU with software emulation (TCG; no KVM needed) boots Debian's stock
# kernel with an initramfs holding busybox, the rxe/ib_uverbs modules,
# rdma-core's libibverbs + rxe provider, the binaries and the shared
# libraries they need. QEMU, the kernel and rdma-core come from a Debian
# bookworm root filesystem made with debootstrap under RXE_VM_DIR, so the
# host only needs debootstrap (installed on demand) and the apt mirror it is
# configured with.
set -euo pipefail

[ "$(id -u)" -eq 0 ] || { echo "rxe-vm.sh: must run as root (debootstrap, chroot, mounts)" >&2; exit 2; }
[ $# -ge 1 ] || { sed -n '2,20p' "$0" >&2; exit 2; }

W=$(realpath -m "${RXE_VM_DIR:-/var/tmp/ferry-rxe-vm}")
C=$W/rootfs
BIN_TIMEOUT=${RXE_VM_BIN_TIMEOUT:-1800}
SMP=${RXE_VM_SMP:-2}
MEM=${RXE_VM_MEM:-2048}
mkdir -p "$W"

for spec in "$@"; do
  b=${spec%%::*}
  [ -x "$b" ] || { echo "rxe-vm.sh: $b is not an executable file" >&2; exit 2; }
done

# Runs a shell command inside the root filesystem, in a private mount
# namespace (nothing stays mounted on the host).
in_root() {
  unshare -m --propagation private bash -c '
    C=$1; shift
    mount -t proc proc "$C/proc"; mount --bind /dev "$C/dev"
    exec chroot "$C" /usr/bin/env -i PATH=/usr/bin:/bin:/usr/sbin:/sbin HOME=/root \
      DEBIAN_FRONTEND=noninteractive bash -c "$1"' bash "$C" "$1"
}

if [ ! -e "$W/.ready" ]; then
  echo "rxe-vm: building the guest root filesystem in $W (once)"
  if ! command -v debootstrap >/dev/null; then
    apt-get install -y -qq --no-install-recommends debootstrap >/dev/null \
      || { apt-get update -qq && apt-get install -y -qq --no-install-recommends debootstrap >/dev/null; }
  fi
  rm -rf "$C"
  MIRROR=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  [ -n "$MIRROR" ] || MIRROR=$(awk '/^deb / {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  [ -n "$MIRROR" ] || { echo "rxe-vm: no Debian mirror found in apt's sources" >&2; exit 1; }
  debootstrap --variant=minbase bookworm "$C" "$MIRROR" >"$W/debootstrap.log" 2>&1 \
    || { tail -20 "$W/debootstrap.log" >&2; exit 1; }
  cp /etc/resolv.conf "$C/etc/resolv.conf"
  in_root 'apt-get update -qq && apt-get install -y -qq --no-install-recommends \
      qemu-system-x86 kmod cpio iproute2 libibverbs1 ibverbs-providers busybox-static >/dev/null'
  in_root 'cd /tmp && K=$(apt-cache depends linux-image-amd64 | awk "/Depends: linux-image/{print \$2}") \
      && apt-get download -qq "$K" && mkdir -p /kernel && dpkg-deb -x /tmp/linux-image-*.deb /kernel \
      && rm -f /tmp/linux-image-*.deb'
  touch "$W/.ready"
fi

# The guest's init: modules, rxe0 on dummy0, then every binary in /t.
cat > "$C/init.guest" <<EOF
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/lib/x86_64-linux-gnu
export HOME=/tmp TMPDIR=/tmp FERRY_VERBS_URL=verbs://rxe0 RUST_BACKTRACE=0 ${RXE_VM_ENV:-}
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev; mount -t tmpfs tmp /tmp
for m in crc32_generic ib_core ib_uverbs udp_tunnel ip6_udp_tunnel rdma_rxe; do
  insmod /mods/\$m.ko || echo "rxe-vm: insmod \$m FAILED"
done
insmod /mods/dummy.ko numdummies=1
ip link set lo up; ip link set dummy0 up; sleep 2
rdma link add rxe0 type rxe netdev dummy0 && rdma link show
cd /tmp
for b in /t/*; do
  case "\$b" in *.args) continue ;; esac
  args="${RXE_VM_ARGS:-}"
  [ -f "\$b.args" ] && args=\$(cat "\$b.args")
  echo "=== \$(basename \$b) \$args"
  timeout $BIN_TIMEOUT "\$b" \$args
  echo "RXE-VM-RC \$(basename \$b) \$?"
done
poweroff -f
EOF

rm -rf "$C/t"; mkdir -p "$C/t"
for spec in "$@"; do
  b=${spec%%::*}
  cp "$b" "$C/t/"
  if [ "$spec" != "$b" ]; then printf '%s' "${spec#*::}" > "$C/t/$(basename "$b").args"; fi
done

in_root '
set -e
K=$(ls /kernel/lib/modules); M=/kernel/lib/modules/$K/kernel
R=/guest; rm -rf $R
mkdir -p $R/bin $R/proc $R/sys $R/dev $R/tmp $R/mods $R/t $R/lib64 $R/etc/libibverbs.d \
         $R/usr/lib/x86_64-linux-gnu/libibverbs
cp /bin/busybox $R/bin/; cp /usr/bin/rdma /usr/sbin/ip $R/bin/
for m in crypto/crc32_generic drivers/infiniband/core/ib_core drivers/infiniband/core/ib_uverbs \
         net/ipv4/udp_tunnel net/ipv6/ip6_udp_tunnel drivers/infiniband/sw/rxe/rdma_rxe drivers/net/dummy; do
  cp $M/$m.ko $R/mods/
done
cp /t/* $R/t/
cp /etc/libibverbs.d/rxe.driver $R/etc/libibverbs.d/
cp -L /usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so $R/usr/lib/x86_64-linux-gnu/libibverbs/
cp -L /usr/lib/x86_64-linux-gnu/libibverbs.so.1 $R/usr/lib/x86_64-linux-gnu/
for f in $(ls $R/t/* | grep -v "\.args$") $R/bin/rdma $R/bin/ip $R/usr/lib/x86_64-linux-gnu/libibverbs/*.so \
         /usr/lib/x86_64-linux-gnu/libibverbs.so.1; do
  ldd $f 2>/dev/null | awk "/=>/ {print \$3}"
done | sort -u | while read l; do [ -f "$l" ] && mkdir -p $R$(dirname $l) && cp -L $l $R$(dirname $l)/; done
cp -L /lib64/ld-linux-x86-64.so.2 $R/lib64/
cp /init.guest $R/init; chmod +x $R/init
cd $R && find . | cpio -o -H newc --quiet | gzip -1 > /initrd.gz
'

TOTAL=$(( BIN_TIMEOUT * $# + 300 ))
echo "rxe-vm: booting the guest ($SMP vCPU, ${MEM} MiB, TCG) for $# binaries"
in_root "cd / && timeout $TOTAL qemu-system-x86_64 -accel tcg,thread=multi -cpu max -m $MEM -smp $SMP \
    -nic none -nographic -no-reboot -kernel /kernel/boot/vmlinuz-* -initrd /initrd.gz \
    -append 'console=ttyS0 panic=-1 loglevel=4'" \
  | sed -u 's/\r$//' | sed -u -n '/^link rxe0\|^===\|^RXE-VM-RC\|^[^\[]/p' | tee "$W/guest.log"
fails=$(grep -c '^RXE-VM-RC .* [1-9][0-9]*$' "$W/guest.log" || true)
runs=$(grep -c '^RXE-VM-RC ' "$W/guest.log" || true)
echo "rxe-vm: $runs of $# binaries run, $fails failed"
[ "$runs" -eq $# ] && [ "$fails" -eq 0 ]
