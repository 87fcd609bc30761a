//! Opening the device, choosing port and GID, creating and connecting RC
//! queue pairs.

use std::ffi::CStr;
use std::sync::Arc;

use ferry_core::{Error, Result};
use rdma_mummy_sys as sys;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, Mtu};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{BasicQueuePair, QueuePair, QueuePairAttribute, QueuePairState};
use sideway::ibverbs::AccessFlags;

use crate::config::VerbsConfig;
use crate::wire::QpEndpoint;
use crate::BACKEND;

const LINK_LAYER_ETHERNET: u8 = 2;

fn unavailable(reason: impl Into<String>) -> Error {
    Error::Unavailable {
        backend: BACKEND.to_owned(),
        reason: reason.into(),
    }
}

/// Maps an errno from a verbs call to [`Error::Backend`].
pub(crate) fn verbs_error(operation: &str, err: &std::io::Error) -> Error {
    Error::Backend {
        backend: BACKEND.to_owned(),
        operation: operation.to_owned(),
        code: i64::from(err.raw_os_error().unwrap_or(0)),
        name: err.to_string(),
    }
}

/// The opened device and everything resolved from it.
pub(crate) struct Device {
    pub ctx: Arc<DeviceContext>,
    pub pd: Arc<ProtectionDomain>,
    pub channel: Arc<CompletionChannel>,
    pub name: String,
    pub port: u8,
    pub gid_index: u8,
    pub gid: [u8; 16],
    pub gid_kind: String,
    pub lid: u16,
    pub ethernet: bool,
    /// Path MTU (verbs enum, 1…5) used for new connections.
    pub mtu: u8,
    pub max_message: u64,
    pub sq_depth: u32,
    pub max_sge: u32,
    pub signal_every: u32,
    pub max_rd_atomic: u8,
    pub cfg: VerbsConfig,
}

fn mtu_bytes(code: u8) -> u32 {
    128u32 << code.clamp(1, 5)
}

fn mtu_code(bytes: u32) -> u8 {
    match bytes {
        0..=256 => 1,
        257..=512 => 2,
        513..=1024 => 3,
        1025..=2048 => 4,
        _ => 5,
    }
}

fn mtu_enum(code: u8) -> Mtu {
    match code {
        1 => Mtu::Mtu256,
        2 => Mtu::Mtu512,
        3 => Mtu::Mtu1024,
        4 => Mtu::Mtu2048,
        _ => Mtu::Mtu4096,
    }
}

fn port_state_name(s: u32) -> &'static str {
    match s {
        1 => "DOWN",
        2 => "INIT",
        3 => "ARMED",
        4 => "ACTIVE",
        5 => "ACTIVE_DEFER",
        _ => "NOP",
    }
}

fn query_port(ctx: &DeviceContext, port: u8) -> std::io::Result<sys::ibv_port_attr> {
    let mut attr = std::mem::MaybeUninit::<sys::ibv_port_attr>::zeroed();
    // SAFETY: the context is open for as long as `ctx` lives; `attr` is a
    // zeroed, correctly sized ibv_port_attr the call fills in.
    let rc = unsafe { sys::ibv_query_port(ctx.context().as_ptr(), port, attr.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(rc));
    }
    // SAFETY: zero-initialised plain data, filled by a successful call.
    Ok(unsafe { attr.assume_init() })
}

/// GID type from sysfs ("RoCE v2", "IB/RoCE v1"), if readable.
fn gid_kind(dev: &str, port: u8, index: u32, ctx: &DeviceContext) -> String {
    let path = format!("/sys/class/infiniband/{dev}/ports/{port}/gid_attrs/types/{index}");
    if let Ok(s) = std::fs::read_to_string(path) {
        return s.trim().to_owned();
    }
    match ctx.query_gid_type(port, index) {
        Ok(1) => "RoCE v2".to_owned(),
        Ok(_) => "IB/RoCE v1".to_owned(),
        Err(_) => "unknown".to_owned(),
    }
}

fn choose_gid(
    ctx: &DeviceContext,
    dev: &str,
    port: u8,
    table_len: i32,
    wanted: Option<u32>,
    ethernet: bool,
) -> Result<(u8, [u8; 16], String)> {
    if let Some(i) = wanted {
        let gid = ctx.query_gid(port, i).map_err(|e| {
            Error::InvalidArgument(format!(
                "gid_index={i}: {dev} port {port} has no such GID ({e}); its table has {table_len} entries"
            ))
        })?;
        if ethernet && gid.is_zero() {
            return Err(Error::InvalidArgument(format!(
                "gid_index={i}: GID {i} of {dev} port {port} is empty (no address on the netdev for it)"
            )));
        }
        return Ok((i as u8, gid.raw, gid_kind(dev, port, i, ctx)));
    }
    let mut best: Option<(u32, u8, Gid, String)> = None;
    for i in 0..table_len.clamp(0, 256) as u32 {
        let Ok(gid) = ctx.query_gid(port, i) else {
            continue;
        };
        if gid.is_zero() {
            continue;
        }
        let kind = gid_kind(dev, port, i, ctx);
        let v2 = kind.contains("v2");
        let v4_mapped = gid.raw[..10].iter().all(|b| *b == 0) && gid.raw[10..12] == [0xff, 0xff];
        let score = match (v2, v4_mapped) {
            (true, true) => 3,
            (true, false) => 2,
            _ => 1,
        };
        if best.as_ref().is_none_or(|b| score > b.0) {
            best = Some((score, i as u8, gid, kind));
        }
    }
    match best {
        Some((_, i, gid, kind)) => Ok((i, gid.raw, kind)),
        None if !ethernet => Ok((0, [0; 16], "none (LID addressing)".to_owned())),
        None => Err(unavailable(format!(
            "{dev} port {port} has no usable GID: give its network interface an IP address"
        ))),
    }
}

fn probe_library() -> Result<()> {
    let name = c"libibverbs.so.1";
    // SAFETY: dlopen with a valid C string; the handle is closed right away
    // (the shim inside rdma-mummy-sys holds its own).
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a thread-local C string or null.
        let why = unsafe {
            let e = libc::dlerror();
            if e.is_null() {
                "unknown error".to_owned()
            } else {
                CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        };
        return Err(unavailable(format!(
            "libibverbs.so.1 cannot be loaded ({why}); install rdma-core (Debian/Ubuntu: libibverbs1 ibverbs-providers)"
        )));
    }
    // SAFETY: handle came from dlopen above.
    unsafe { libc::dlclose(handle) };
    Ok(())
}

impl Device {
    /// Opens the configured device (see [`VerbsConfig`]).
    pub(crate) fn open(cfg: &VerbsConfig) -> Result<Device> {
        probe_library()?;
        let list = DeviceList::new().map_err(|e| {
            unavailable(format!(
                "ibv_get_device_list failed ({}): this kernel has no RDMA support or no RDMA driver is loaded",
                std::error::Error::source(&e).map(ToString::to_string).unwrap_or_else(|| e.to_string())
            ))
        })?;
        if list.is_empty() {
            return Err(unavailable(
                "no RDMA device found (for soft-RoCE: `modprobe rdma_rxe && rdma link add rxe0 type rxe netdev IFACE`)",
            ));
        }
        let mut seen = Vec::new();
        let mut chosen = None;
        for dev in list.iter() {
            let name = dev.name();
            if let Some(want) = &cfg.device {
                if &name != want {
                    seen.push(name);
                    continue;
                }
            }
            let ctx = dev
                .open()
                .map_err(|e| unavailable(format!("cannot open {name}: {e}")))?;
            match query_port(&ctx, cfg.port) {
                Ok(attr) if attr.state == 4 || attr.state == 5 => {
                    chosen = Some((name, ctx, attr));
                    break;
                }
                Ok(attr) => seen.push(format!(
                    "{name} (port {} is {})",
                    cfg.port,
                    port_state_name(attr.state)
                )),
                Err(e) => seen.push(format!("{name} (port {}: {e})", cfg.port)),
            }
        }
        let Some((name, ctx, port)) = chosen else {
            return Err(unavailable(match &cfg.device {
                Some(want) => format!(
                    "RDMA device {want:?} with an active port {} not found; devices: {}",
                    cfg.port,
                    seen.join(", ")
                ),
                None => format!(
                    "no RDMA device has an active port {}: {}",
                    cfg.port,
                    seen.join(", ")
                ),
            }));
        };
        let dev_attr = ctx
            .query_device()
            .map_err(|e| unavailable(format!("ibv_query_device on {name}: {e}")))?;
        let ethernet = port.link_layer == LINK_LAYER_ETHERNET;
        let (gid_index, gid, gid_kind) = choose_gid(
            &ctx,
            &name,
            cfg.port,
            port.gid_tbl_len,
            cfg.gid_index,
            ethernet,
        )?;
        let active = port.active_mtu.clamp(1, 5) as u8;
        let mtu = match cfg.mtu {
            Some(m) => mtu_code(m).min(active),
            None => active,
        };
        let port_max = if port.max_msg_sz == 0 {
            1 << 30
        } else {
            u64::from(port.max_msg_sz)
        };
        let max_message = cfg
            .max_message
            .unwrap_or(port_max)
            .min(port_max)
            .min(1 << 30);
        let sq_depth = cfg.sq_depth.min(dev_attr.max_qp_wr().max(2) as u32).max(2);
        let max_sge = cfg
            .max_sge
            .min(dev_attr.max_sge().max(1) as u32)
            .min(dev_attr.max_sge_rd().max(1) as u32)
            .max(1);
        let signal_every = cfg.signal_every.clamp(1, (sq_depth / 2).max(1));
        let max_rd_atomic = cfg
            .max_rd_atomic
            .min(dev_attr.max_qp_rd_atom().clamp(1, 255) as u8)
            .min(dev_attr.max_qp_init_rd_atom().clamp(1, 255) as u8)
            .max(1);
        let pd = ctx
            .alloc_pd()
            .map_err(|e| unavailable(format!("ibv_alloc_pd on {name}: {e}")))?;
        let channel = ctx
            .create_comp_channel()
            .map_err(|e| unavailable(format!("ibv_create_comp_channel on {name}: {e}")))?;
        channel
            .set_nonblocking(true)
            .map_err(|e| Error::io("making the completion channel non-blocking", &e))?;
        Ok(Device {
            ctx,
            pd,
            channel,
            name,
            port: cfg.port,
            gid_index,
            gid,
            gid_kind,
            lid: port.lid,
            ethernet,
            mtu,
            max_message,
            sq_depth,
            max_sge,
            signal_every,
            max_rd_atomic,
            cfg: cfg.clone(),
        })
    }

    /// Facts for the capability report.
    pub(crate) fn details(&self) -> Vec<(String, String)> {
        let c = &self.cfg;
        let ack_ms = 4.096e-3 * f64::from(1u32 << c.timeout.min(31));
        vec![
            ("library".into(), "libibverbs.so.1 (dlopen, sideway)".into()),
            ("device".into(), self.name.clone()),
            ("port".into(), self.port.to_string()),
            (
                "link layer".into(),
                if self.ethernet { "Ethernet (RoCE)" } else { "InfiniBand" }.into(),
            ),
            (
                "gid".into(),
                format!(
                    "index {} = {} ({})",
                    self.gid_index,
                    std::net::Ipv6Addr::from(self.gid),
                    self.gid_kind
                ),
            ),
            ("lid".into(), self.lid.to_string()),
            ("path mtu".into(), mtu_bytes(self.mtu).to_string()),
            ("max message".into(), self.max_message.to_string()),
            ("sq depth".into(), self.sq_depth.to_string()),
            ("max sge".into(), self.max_sge.to_string()),
            ("signal every".into(), self.signal_every.to_string()),
            (
                "qp timeouts".into(),
                format!(
                    "ack timeout {} (≈{ack_ms:.1} ms), retry_cnt {}, rnr_retry {}, min_rnr_timer {}, max_rd_atomic {}",
                    c.timeout, c.retry_cnt, c.rnr_retry, c.min_rnr_timer, self.max_rd_atomic
                ),
            ),
        ]
    }

    /// A completion queue of `cqe` entries, on the completion channel if
    /// `events`.
    pub(crate) fn create_cq(&self, cqe: u32, events: bool) -> Result<Arc<BasicCompletionQueue>> {
        let mut b = self.ctx.create_cq_builder();
        b.setup_cqe(cqe);
        if events {
            b.setup_comp_channel(&self.channel, 0);
        }
        b.build()
            .map_err(|e| verbs_error("ibv_create_cq", &io_of(&e)))
    }

    /// An RC queue pair on `cq` with room for `send_wr` send and `recv_wr`
    /// receive work requests, moved to INIT.
    pub(crate) fn create_qp(
        &self,
        cq: &Arc<BasicCompletionQueue>,
        send_wr: u32,
        recv_wr: u32,
        sge: u32,
    ) -> Result<BasicQueuePair> {
        let mut qp = self
            .pd
            .create_qp_builder()
            .setup_max_send_wr(send_wr)
            .setup_max_recv_wr(recv_wr.max(1))
            .setup_max_send_sge(sge)
            .setup_max_recv_sge(1)
            .setup_send_cq(Arc::clone(cq))
            .setup_recv_cq(Arc::clone(cq))
            .build()
            .map_err(|e| verbs_error("ibv_create_qp", &io_of(&e)))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(self.port)
            .setup_access_flags(
                AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead,
            );
        qp.modify(&attr)
            .map_err(|e| verbs_error("ibv_modify_qp(INIT)", &io_of(&e)))?;
        Ok(qp)
    }

    /// This side's addressing data for `qp`.
    pub(crate) fn endpoint(&self, qp: &BasicQueuePair, psn: u32) -> QpEndpoint {
        QpEndpoint {
            qpn: qp.qp_number(),
            psn,
            lid: self.lid,
            gid: self.gid,
            mtu: self.mtu,
        }
    }

    /// INIT → RTR → RTS towards `remote`, with the configured timeouts and
    /// retry counts. `mtu` is the agreed path MTU code.
    pub(crate) fn connect_qp(
        &self,
        qp: &mut BasicQueuePair,
        local_psn: u32,
        remote: &QpEndpoint,
        mtu: u8,
    ) -> Result<()> {
        let c = &self.cfg;
        let mut av = AddressHandleAttribute::new();
        av.setup_dest_lid(remote.lid)
            .setup_service_level(c.service_level)
            .setup_port(self.port);
        if self.ethernet || remote.gid != [0; 16] {
            av.setup_grh(
                &Gid { raw: remote.gid },
                0,
                self.gid_index,
                c.hop_limit,
                c.traffic_class,
            );
        }
        let mut rtr = QueuePairAttribute::new();
        rtr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu_enum(mtu))
            .setup_dest_qp_num(remote.qpn)
            .setup_rq_psn(remote.psn & 0xff_ffff)
            .setup_max_dest_read_atomic(self.max_rd_atomic)
            .setup_min_rnr_timer(c.min_rnr_timer)
            .setup_address_vector(&av);
        qp.modify(&rtr)
            .map_err(|e| verbs_error("ibv_modify_qp(RTR)", &io_of(&e)))?;
        let mut rts = QueuePairAttribute::new();
        rts.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(local_psn & 0xff_ffff)
            .setup_timeout(c.timeout)
            .setup_retry_cnt(c.retry_cnt)
            .setup_rnr_retry(c.rnr_retry)
            .setup_max_read_atomic(self.max_rd_atomic);
        qp.modify(&rts)
            .map_err(|e| verbs_error("ibv_modify_qp(RTS)", &io_of(&e)))?;
        Ok(())
    }
}

/// Moves `qp` to the Error state (flushing its outstanding work requests).
pub(crate) fn qp_to_error(qp: &mut BasicQueuePair) -> Result<()> {
    let mut attr = QueuePairAttribute::new();
    attr.setup_state(QueuePairState::Error);
    qp.modify(&attr)
        .map_err(|e| verbs_error("ibv_modify_qp(ERR)", &io_of(&e)))
}

/// The innermost `io::Error` of a sideway error, or its message.
pub(crate) fn io_of(e: &(dyn std::error::Error + 'static)) -> std::io::Error {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            return std::io::Error::new(io.kind(), io.to_string())
                .raw_os_error()
                .map(std::io::Error::from_raw_os_error)
                .unwrap_or_else(|| std::io::Error::new(io.kind(), io.to_string()));
        }
        cur = err.source();
    }
    std::io::Error::other(e.to_string())
}

/// The agreed path MTU of two endpoints.
pub(crate) fn agree_mtu(a: u8, b: u8) -> u8 {
    a.min(b).clamp(1, 5)
}

/// A fresh 24-bit packet sequence number.
pub(crate) fn random_psn() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    (h.finish() as u32) & 0xff_ffff
}

/// Symbolic name of a work-completion status.
pub(crate) fn wc_status_name(status: u32) -> &'static str {
    const NAMES: [&str; 24] = [
        "IBV_WC_SUCCESS",
        "IBV_WC_LOC_LEN_ERR",
        "IBV_WC_LOC_QP_OP_ERR",
        "IBV_WC_LOC_EEC_OP_ERR",
        "IBV_WC_LOC_PROT_ERR",
        "IBV_WC_WR_FLUSH_ERR",
        "IBV_WC_MW_BIND_ERR",
        "IBV_WC_BAD_RESP_ERR",
        "IBV_WC_LOC_ACCESS_ERR",
        "IBV_WC_REM_INV_REQ_ERR",
        "IBV_WC_REM_ACCESS_ERR",
        "IBV_WC_REM_OP_ERR",
        "IBV_WC_RETRY_EXC_ERR",
        "IBV_WC_RNR_RETRY_EXC_ERR",
        "IBV_WC_LOC_RDD_VIOL_ERR",
        "IBV_WC_REM_INV_RD_REQ_ERR",
        "IBV_WC_REM_ABORT_ERR",
        "IBV_WC_INV_EECN_ERR",
        "IBV_WC_INV_EEC_STATE_ERR",
        "IBV_WC_FATAL_ERR",
        "IBV_WC_RESP_TIMEOUT_ERR",
        "IBV_WC_GENERAL_ERR",
        "IBV_WC_TM_ERR",
        "IBV_WC_TM_RNDV_INCOMPLETE",
    ];
    NAMES
        .get(status as usize)
        .copied()
        .unwrap_or("IBV_WC_UNKNOWN")
}

/// A zeroed heap buffer of `count` slots of `slot` bytes, registered with
/// the protection domain (local write; no remote access): the notification
/// SENDs of an opener and the receive ring of an owner. Only raw pointers
/// ever touch the memory, since the device writes it behind Rust's back.
pub(crate) struct Slots {
    mr: Option<Arc<sideway::ibverbs::memory_region::MemoryRegion>>,
    ptr: *mut u8,
    layout: std::alloc::Layout,
    slot: usize,
    count: usize,
}

// SAFETY: the buffer is plain bytes owned by this value; callers coordinate
// which slot the device may use (see `write` / `read`).
unsafe impl Send for Slots {}
// SAFETY: as above; `&self` methods only hand out copies.
unsafe impl Sync for Slots {}

impl Slots {
    /// Allocates and registers the buffer (a blocking verbs call: run it
    /// off the async workers).
    pub(crate) fn new(dev: &Device, count: usize, slot: usize) -> Result<Slots> {
        let layout = std::alloc::Layout::from_size_align(count * slot, 64)
            .map_err(|e| Error::InvalidArgument(format!("notification buffer: {e}")))?;
        // SAFETY: the layout has a non-zero size (count, slot > 0).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Error::io(
                "allocating a notification buffer",
                &std::io::Error::from(std::io::ErrorKind::OutOfMemory),
            ));
        }
        let mut s = Slots {
            mr: None,
            ptr,
            layout,
            slot,
            count,
        };
        // SAFETY: the range is the allocation above, which lives until this
        // value drops, after the MR (deregistered first in Drop).
        let mr = unsafe {
            dev.pd
                .reg_mr(ptr as usize, count * slot, AccessFlags::LocalWrite)
        }
        .map_err(|e| verbs_error("ibv_reg_mr (notification buffer)", &io_of(&e)))?;
        s.mr = Some(mr);
        Ok(s)
    }

    pub(crate) fn lkey(&self) -> u32 {
        self.mr.as_ref().map_or(0, |m| m.lkey())
    }

    pub(crate) fn count(&self) -> usize {
        self.count
    }

    pub(crate) fn slot_len(&self) -> usize {
        self.slot
    }

    /// Device address of slot `i`.
    pub(crate) fn addr(&self, i: usize) -> u64 {
        self.ptr as u64 + (i.min(self.count - 1) * self.slot) as u64
    }

    /// Copies `bytes` (at most a slot) into slot `i`.
    ///
    /// # Safety
    ///
    /// No work request that uses slot `i` may be outstanding.
    pub(crate) unsafe fn write(&self, i: usize, bytes: &[u8]) {
        let n = bytes.len().min(self.slot);
        // SAFETY: slot `i` (clamped) lies in the allocation; nothing else
        // accesses it (the caller's promise).
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.addr(i) as *mut u8, n);
        }
    }

    /// The first `len` bytes (at most a slot) of slot `i`.
    ///
    /// # Safety
    ///
    /// The device must be done writing slot `i` (its receive completed) and
    /// no new receive on it be posted yet.
    pub(crate) unsafe fn read(&self, i: usize, len: usize) -> Vec<u8> {
        let n = len.min(self.slot);
        let mut out = vec![0u8; n];
        // SAFETY: as for `write`.
        unsafe {
            std::ptr::copy_nonoverlapping(self.addr(i) as *const u8, out.as_mut_ptr(), n);
        }
        out
    }
}

impl Drop for Slots {
    fn drop(&mut self) {
        // Deregister before the memory goes.
        self.mr.take();
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}
