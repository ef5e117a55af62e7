#!/bin/bash
# testvm.sh — real InfiniBand verbs for tests on a host without RDMA: boots Debian's own kernel
# (which has rdma_rxe, the kernel's soft-RoCE driver) under QEMU/TCG, with the host's root file
# system shared read-only over virtio-9p beneath a tmpfs overlay, so the guest runs the host's
# binaries as they are. The guest creates the soft-RoCE device rxe0 on its network interface,
# runs one bash script as root, and powers off; this script exits with the script's status.
#
#   scripts/testvm.sh prepare            fetch + unpack the kernel package, build the initramfs
#   scripts/testvm.sh run SCRIPT [KEY=VALUE...]
#                                        boot one guest, run SCRIPT in it; exit with its status
#   scripts/testvm.sh check              one guest: rxe0 is an active RoCE port (smoke test)
#   scripts/testvm.sh check2             two guests joined by a UDP wire: RC ping-pong between them
#
# KEY=VALUE settings of `run` (all optional):
#   name=vm            guest host name          ip=10.0.2.15/24   address of eth0
#   mac=52:54:00:..    MAC of eth0 (two guests need different ones, else the same GID)
#   wire=LOCAL:REMOTE  join eth0 to another guest's over UDP on 127.0.0.1 (no DHCP, no gateway)
#   share=DIR          host directory mounted at /share in the guest (default: a temp dir)
#   mem=2048 cpus=2 timeout=900 (seconds, whole boot-run-poweroff)
#
# Host packages (scripts/setup.sh --vm installs them): qemu-system-x86 busybox-static cpio
# rdma-core ibverbs-utils ibverbs-providers. Everything else lives in $CKPT_VM_DIR
# (default /var/cache/ckpt-vm). Every wait is bounded; QEMU is started by this script and ends
# with the guest (or is killed by `timeout`).
set -euo pipefail

VM_DIR=${CKPT_VM_DIR:-/var/cache/ckpt-vm}
# Modules the initramfs loads before switching root, in dependency order once resolved.
# rdma_rxe asks the crypto API for crc32 at run time, so those are listed too.
MODULES="virtio_pci virtio_net 9pnet_virtio 9p overlay crc32_generic crc32_pclmul ib_core ib_uverbs rdma_rxe"

die() { echo "testvm: $*" >&2; exit 2; }
say() { echo "testvm: $*" >&2; }

kernel_abi() {
    # The ABI of the kernel package Debian's linux-image-amd64 points at now.
    apt-cache depends linux-image-amd64 2>/dev/null | sed -n 's/^ *Depends: linux-image-\(.*\)$/\1/p' | head -1
}

current() { cat "$VM_DIR/abi" 2>/dev/null || true; }

prepare() {
    for t in qemu-system-x86_64 busybox cpio gzip apt-get dpkg-deb; do
        command -v "$t" >/dev/null || die "$t is missing (scripts/setup.sh --vm installs what the test VM needs)"
    done
    mkdir -p "$VM_DIR"
    local abi; abi=$(kernel_abi)
    [ -n "$abi" ] || abi=$(current)
    [ -n "$abi" ] || die "cannot tell which linux-image package to use (run apt-get update)"
    local kdir="$VM_DIR/kernel-$abi"
    if [ ! -f "$kdir/boot/vmlinuz-$abi" ]; then
        say "fetching linux-image-$abi"
        local dl; dl=$(mktemp -d "$VM_DIR/dl.XXXXXX")
        (cd "$dl" && apt-get download -qq "linux-image-$abi") || { rm -rf "$dl"; die "apt-get download linux-image-$abi failed"; }
        rm -rf "$kdir.tmp"; dpkg-deb -x "$dl"/linux-image-"$abi"_*.deb "$kdir.tmp"
        rm -rf "$dl"
        # The guest's modprobe (busybox) needs modules.dep; the package leaves it to depmod.
        busybox depmod -b "$kdir.tmp" "$abi"
        rm -rf "$kdir"; mv "$kdir.tmp" "$kdir"
    fi
    build_initramfs "$abi" "$kdir"
    echo "$abi" > "$VM_DIR/abi"
    say "ready: kernel $abi, initramfs $VM_DIR/initramfs-$abi.cpio.gz"
}

# Prints the path of module $1's file and, first, those of the modules it depends on (as the
# .modinfo section of each file lists them), each once.
declare -A LISTED=()
module_chain() {
    local name=$1 kdir=$2 abi=$3 file dep
    [ -z "${LISTED[$name]:-}" ] || return 0
    LISTED[$name]=1
    file=$(find "$kdir/lib/modules/$abi/kernel" -name "$name.ko" -o -name "${name//_/-}.ko" | head -1)
    if [ -z "$file" ]; then
        grep -q "/${name}.ko" "$kdir/lib/modules/$abi/modules.builtin" && return 0
        die "kernel module $name not found in linux-image-$abi"
    fi
    for dep in $(tr '\0' '\n' < "$file" | sed -n 's/^depends=//p' | tr ',' ' '); do
        module_chain "$dep" "$kdir" "$abi"
    done
    echo "$file"
}

build_initramfs() {
    local abi=$1 kdir=$2 root; root=$(mktemp -d "$VM_DIR/initramfs.XXXXXX")
    mkdir -p "$root"/{bin,modules,proc,sys,dev,host,rw,root}
    cp "$(command -v busybox)" "$root/bin/busybox"
    local m; : > "$root/modules/order"
    for m in $MODULES; do
        module_chain "$m" "$kdir" "$abi" > "$root/chain"
        while read -r f; do
            cp "$f" "$root/modules/"; basename "$f" >> "$root/modules/order"
        done < "$root/chain"
    done
    rm -f "$root/chain"
    # Stage 1 (initramfs): modules, the host root read-only with a tmpfs on top, switch root.
    cat > "$root/init" <<'EOF'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
while read -r m; do insmod "/modules/$m" || echo "testvm-init: insmod $m failed"; done < /modules/order
# A tentative IPv6 link-local address would leave the RoCE GID at index 0 unusable.
echo 0 > /proc/sys/net/ipv6/conf/default/accept_dad
echo 0 > /proc/sys/net/ipv6/conf/eth0/accept_dad
opts=trans=virtio,version=9p2000.L,msize=262144
mount -t 9p -o "$opts,ro,cache=loose" host /host || { echo "testvm-init: cannot mount the host root"; poweroff -f; }
mount -t tmpfs -o size=1g rw /rw; mkdir /rw/upper /rw/work
mount -t overlay -o lowerdir=/host,upperdir=/rw/upper,workdir=/rw/work root /root
mkdir -p /root/share; mount -t 9p -o "$opts,cache=none" share /root/share
for d in proc sys dev; do mount --move "/$d" "/root/$d"; done
mount -t tmpfs run /root/run; mkdir -p /root/run/testvm /root/dev/pts /root/dev/shm
mount -t devpts -o ptmxmode=666 devpts /root/dev/pts; mount -t tmpfs shm /root/dev/shm
mount -t cgroup2 cgroup2 /root/sys/fs/cgroup 2>/dev/null || true
cp /bin/busybox /stage2 /root/run/testvm/
# Other modules load on demand (CRIU asks for some) from the unpacked package, through busybox.
mkdir -p /root/lib/modules; ln -sfn @MODULES_DIR@ "/root/lib/modules/$(uname -r)"
ln -s busybox /root/run/testvm/modprobe; echo /run/testvm/modprobe > /root/proc/sys/kernel/modprobe
exec switch_root /root /run/testvm/busybox sh /run/testvm/stage2
EOF
    # Stage 2 (the host's root): network, rxe0, the test script, its status, power off.
    cat > "$root/stage2" <<'EOF'
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LC_ALL=C
# Several guests may share one directory: each one's files carry its name (kernel command line).
VM_NAME=$(sed -n 's/.*testvm\.name=\([^ ]*\).*/\1/p' /proc/cmdline)
. "/share/.testvm-$VM_NAME.env"
hostname "$VM_NAME"
ip link set lo up; ip link set eth0 up; ip addr add "$VM_IP" dev eth0
[ -z "$VM_GW" ] || ip route add default via "$VM_GW"
rdma link add rxe0 type rxe netdev eth0 || echo "testvm: rdma link add rxe0 failed"
# rxe's GIDs are RoCE v2: a connect routes even a link-local GID through eth0's IPv6 link-local
# address, which comes only once the link reports carrier. A test that connects before it meets
# ENETUNREACH in modify_qp(RTR), so wait for it (5 s at most) before the test runs.
for _ in $(seq 50); do
    ip -6 -o addr show dev eth0 scope link | grep -v tentative | grep -q 'inet6 fe80' && break
    sleep 0.1
done
ip -6 -o addr show dev eth0 scope link | grep -q 'inet6 fe80' || echo "testvm: eth0 has no IPv6 link-local address"
# CRIU opens /dev/net/tun, which loads no module by itself here.
/run/testvm/modprobe tun || echo "testvm: modprobe tun failed"
cd /share
/usr/bin/setsid -w /bin/bash "/share/.testvm-$VM_NAME.sh" </dev/null >/dev/console 2>&1
echo $? > "/share/.testvm-$VM_NAME.status"
sync
/run/testvm/busybox poweroff -f
EOF
    sed -i "s|@MODULES_DIR@|$kdir/lib/modules/$abi|" "$root/init"
    chmod +x "$root/init"
    (cd "$root" && find . | cpio -o -H newc --quiet | gzip -1) > "$VM_DIR/initramfs-$abi.cpio.gz.tmp"
    mv "$VM_DIR/initramfs-$abi.cpio.gz.tmp" "$VM_DIR/initramfs-$abi.cpio.gz"
    rm -rf "$root"
}

run() {
    local script=${1:-}; [ -f "$script" ] || die "usage: testvm.sh run SCRIPT [KEY=VALUE...]"
    shift
    local name=vm ip=10.0.2.15/24 mac=52:54:00:12:34:56 wire= share= mem=2048 cpus=2 timeout=900 kv
    for kv in "$@"; do
        case "$kv" in
            name=*|ip=*|mac=*|wire=*|share=*|mem=*|cpus=*|timeout=*) eval "${kv%%=*}=\${kv#*=}" ;;
            *) die "unknown setting $kv" ;;
        esac
    done
    local abi; abi=$(current); [ -n "$abi" ] || die "not prepared: run scripts/testvm.sh prepare"
    local tmp_share=
    if [ -z "$share" ]; then share=$(mktemp -d); tmp_share=$share; fi
    mkdir -p "$share"
    cp "$script" "$share/.testvm-$name.sh"; rm -f "$share/.testvm-$name.status"
    local net gw=10.0.2.2
    if [ -n "$wire" ]; then
        net="dgram,id=n0,local.type=inet,local.host=127.0.0.1,local.port=${wire%%:*},remote.type=inet,remote.host=127.0.0.1,remote.port=${wire##*:}"
        gw=
    else
        net="user,id=n0"
    fi
    printf 'VM_NAME=%q\nVM_IP=%q\nVM_GW=%q\n' "$name" "$ip" "$gw" > "$share/.testvm-$name.env"
    local begin=$SECONDS rc=0
    timeout --kill-after=10 "$timeout" qemu-system-x86_64 -accel tcg -cpu max -smp "$cpus" -m "$mem" \
        -display none -monitor none -serial stdio -no-reboot \
        -kernel "$VM_DIR/kernel-$abi/boot/vmlinuz-$abi" -initrd "$VM_DIR/initramfs-$abi.cpio.gz" \
        -append "console=ttyS0 loglevel=3 panic=-1 testvm.name=$name" \
        -fsdev local,id=host,path=/,security_model=none,readonly=on,multidevs=remap \
        -device virtio-9p-pci,fsdev=host,mount_tag=host \
        -fsdev "local,id=share,path=$share,security_model=none" -device virtio-9p-pci,fsdev=share,mount_tag=share \
        -netdev "$net" -device "virtio-net-pci,netdev=n0,mac=$mac" </dev/null || rc=$?
    local status; status=$(cat "$share/.testvm-$name.status" 2>/dev/null || true)
    say "$name: $((SECONDS - begin)) s, qemu exit $rc, script status ${status:-none}"
    [ -z "$tmp_share" ] || rm -rf "$tmp_share"
    [ -n "$status" ] || return 125
    return "$status"
}

check() {
    local t; t=$(mktemp)
    cat > "$t" <<'EOF'
ibv_devinfo -d rxe0 | grep -E 'transport|state|link_layer'
ibv_devinfo -d rxe0 | grep -q PORT_ACTIVE
EOF
    run "$t" name=check; local rc=$?; rm -f "$t"; return $rc
}

check2() {
    local a b sa sb
    a=$(mktemp); b=$(mktemp)
    echo 'timeout 120 ibv_rc_pingpong -d rxe0 -g 0 -n 100' > "$a"
    cat > "$b" <<'EOF'
for i in $(seq 60); do busybox ping -c1 -W1 192.168.97.1 >/dev/null 2>&1 && break; done
for i in $(seq 60); do timeout 30 ibv_rc_pingpong -d rxe0 -g 0 -n 100 192.168.97.1 && exit 0; sleep 0.5; done
exit 1
EOF
    run "$a" name=a ip=192.168.97.1/24 mac=52:54:00:00:97:01 wire=17971:17972 timeout=300 & sa=$!
    run "$b" name=b ip=192.168.97.2/24 mac=52:54:00:00:97:02 wire=17972:17971 timeout=300 & sb=$!
    local ra=0 rb=0; wait $sa || ra=$?; wait $sb || rb=$?
    rm -f "$a" "$b"
    say "two guests: a=$ra b=$rb"; [ "$ra$rb" = 00 ]
}

case "${1:-}" in
    prepare) prepare ;;
    run) shift; run "$@" ;;
    check) check ;;
    check2) check2 ;;
    *) sed -n 2,24p "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
