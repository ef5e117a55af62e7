//! The rdma-core backend: [`Verbs`] on a real device through libibverbs.
//!
//! The calls are made through `ibverbs-sys` directly. The safe `ibverbs` crate releases its
//! objects only in `Drop` and panics when the device refuses; a quiesce must release every
//! object in a fixed order and report a refusal, so this backend owns raw handles instead.
//! `ibv_post_send`, `ibv_post_recv` and `ibv_poll_cq` are inline functions in `verbs.h`; they
//! are called here the same way, through the context's operation table.
use std::ffi::CStr;
use std::os::raw::c_int;
use std::ptr;

use ibverbs_sys as ffi;

use crate::verbs::{
    link_layer_name, Completion, Handle, MrKeys, Opcode, Port, QpCaps, RecvWr, Remote, SendOp,
    SendWr, Sge, VResult, Verbs, VerbsError,
};

/// The port every object uses (rxe and single-port HCAs have only port 1).
const PORT: u8 = 1;

/// A device context and what a QP needs to address the port.
#[derive(Debug)]
pub struct Rdma {
    ctx: *mut ffi::ibv_context,
    gid_index: u8,
    mtu: ffi::ibv_mtu,
    /// Completion slots for `poll_cq`, allocated once: polling is the hot path.
    wcs: Vec<ffi::ibv_wc>,
    /// The scatter list of the request being posted, reused from post to post.
    sgs: Vec<ffi::ibv_sge>,
}

/// Completions one `poll_cq` call takes at most.
const POLL_MAX: usize = 64;

// SAFETY: libibverbs objects may be used from any thread; the channel serialises calls.
unsafe impl Send for Rdma {}

impl Default for Rdma {
    fn default() -> Self {
        Self::new()
    }
}

fn err(op: &'static str, message: impl Into<String>) -> VerbsError {
    VerbsError {
        op,
        message: message.into(),
    }
}

/// A call's return code (0 or an errno) as an error.
fn rc(op: &'static str, r: c_int) -> VResult<()> {
    if r == 0 {
        Ok(())
    } else {
        let e = if r < 0 {
            std::io::Error::last_os_error()
        } else {
            std::io::Error::from_raw_os_error(r)
        };
        Err(err(op, e.to_string()))
    }
}

/// A returned pointer, or the errno it left, as an error.
fn non_null<T>(op: &'static str, p: *mut T) -> VResult<*mut T> {
    if p.is_null() {
        Err(err(op, std::io::Error::last_os_error().to_string()))
    } else {
        Ok(p)
    }
}

impl Rdma {
    /// A backend with no device open yet. The GID index comes from `IBQ_GID_INDEX` (default 0,
    /// which on RoCE is the port's first address).
    pub fn new() -> Self {
        let gid_index = std::env::var("IBQ_GID_INDEX")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        Rdma {
            ctx: ptr::null_mut(),
            gid_index,
            mtu: ffi::IBV_MTU_1024,
            // SAFETY: ibv_wc is plain data, valid when zeroed.
            wcs: vec![unsafe { std::mem::zeroed() }; POLL_MAX],
            sgs: Vec::new(),
        }
    }

    fn ctx(&self, op: &'static str) -> VResult<*mut ffi::ibv_context> {
        if self.ctx.is_null() {
            Err(err(op, "no device is open"))
        } else {
            Ok(self.ctx)
        }
    }

    fn query_port(ctx: *mut ffi::ibv_context) -> VResult<ffi::ibv_port_attr> {
        let mut attr = ffi::ibv_port_attr::default();
        // SAFETY: the exported ibv_query_port fills the compatibility layout, a prefix of
        // ibv_port_attr, which is the larger buffer passed.
        let r = unsafe {
            ffi::ibv_query_port(
                ctx,
                PORT,
                &mut attr as *mut ffi::ibv_port_attr as *mut ffi::_compat_ibv_port_attr,
            )
        };
        rc("ibv_query_port", r)?;
        Ok(attr)
    }
}

/// Names of the verbs devices on this host, as libibverbs lists them.
pub fn device_names() -> Vec<String> {
    let mut n: c_int = 0;
    // SAFETY: the list is freed below and its entries not used after.
    unsafe {
        let list = ffi::ibv_get_device_list(&mut n);
        if list.is_null() {
            return Vec::new();
        }
        let names = (0..n as usize)
            .map(|i| {
                CStr::from_ptr(ffi::ibv_get_device_name(*list.add(i)))
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        ffi::ibv_free_device_list(list);
        names
    }
}

/// Moves a live QP with `attr`/`mask`; `op` names the transition in errors.
fn modify_qp(
    qp: *mut ffi::ibv_qp,
    op: &'static str,
    mut attr: ffi::ibv_qp_attr,
    mask: ffi::ibv_qp_attr_mask,
) -> VResult<()> {
    // SAFETY: the callers pass a live QP; attr is fully initialised.
    rc(op, unsafe {
        ffi::ibv_modify_qp(qp, &mut attr, mask.0 as c_int)
    })
}

/// Fills `out` with `sges` in the library's layout (the buffer is reused across posts).
fn sg_list<'a>(out: &'a mut Vec<ffi::ibv_sge>, sges: &[Sge]) -> &'a mut Vec<ffi::ibv_sge> {
    out.clear();
    out.extend(sges.iter().map(|s| ffi::ibv_sge {
        addr: s.addr,
        length: s.len,
        lkey: s.lkey,
    }));
    out
}

impl Rdma {
    /// Opens the first listed device named `want` (any, if None) whose port `usable` accepts;
    /// `none` words the error when there is none, given the names found. Devices with another
    /// name are not opened.
    fn open_first(
        &mut self,
        want: Option<&str>,
        usable: impl Fn(&ffi::ibv_port_attr) -> bool,
        none: impl FnOnce(&[String]) -> String,
    ) -> VResult<Port> {
        if !self.ctx.is_null() {
            return Err(err("ibv_open_device", "a device is already open"));
        }
        let mut n: c_int = 0;
        // SAFETY: every device pointer is used while the list lives; the context outlives it.
        unsafe {
            let list = non_null("ibv_get_device_list", ffi::ibv_get_device_list(&mut n))?;
            let mut found = Vec::new();
            let mut chosen: Option<(*mut ffi::ibv_context, String, ffi::ibv_port_attr)> = None;
            for i in 0..n as usize {
                let dev = *list.add(i);
                let name = CStr::from_ptr(ffi::ibv_get_device_name(dev))
                    .to_string_lossy()
                    .into_owned();
                found.push(name.clone());
                if want.is_some_and(|w| w != name) {
                    continue;
                }
                let ctx = ffi::ibv_open_device(dev);
                if ctx.is_null() {
                    continue;
                }
                match Self::query_port(ctx) {
                    Ok(port) if usable(&port) => {
                        chosen = Some((ctx, name, port));
                        break;
                    }
                    _ => {
                        ffi::ibv_close_device(ctx);
                    }
                }
            }
            ffi::ibv_free_device_list(list);
            let Some((ctx, name, port)) = chosen else {
                return Err(err("ibv_open_device", none(&found)));
            };
            let mut gid = ffi::ibv_gid::default();
            let r = ffi::ibv_query_gid(ctx, PORT, self.gid_index as c_int, &mut gid);
            if r != 0 {
                ffi::ibv_close_device(ctx);
                return Err(err(
                    "ibv_query_gid",
                    format!("GID index {} of {name}: error {r}", self.gid_index),
                ));
            }
            self.ctx = ctx;
            self.mtu = port.active_mtu;
            Ok(Port {
                device: name,
                lid: port.lid,
                gid: gid.raw,
                link_layer: port.link_layer,
            })
        }
    }
}

fn active(port: &ffi::ibv_port_attr) -> bool {
    port.state == ffi::ibv_port_state::IBV_PORT_ACTIVE
}

impl Verbs for Rdma {
    fn device_fds(&self) -> Option<Vec<i32>> {
        if self.ctx.is_null() {
            return Some(Vec::new());
        }
        // SAFETY: an open context; `cmd_fd` is plain data set when it was opened.
        Some(vec![unsafe { (*self.ctx).cmd_fd }])
    }

    fn open(&mut self, device: &str) -> VResult<Port> {
        if device.is_empty() {
            // Without a name, the first device whose port is up.
            self.open_first(None, active, |found| {
                format!("no verbs device with an active port (found: {found:?})")
            })
        } else {
            self.open_first(
                Some(device),
                |_| true,
                |found| format!("device {device} not found or not openable (found: {found:?})"),
            )
        }
    }

    fn open_matching(&mut self, like: &Port) -> VResult<Port> {
        self.open_first(
            None,
            |port| active(port) && port.link_layer == like.link_layer,
            |found| {
                format!(
                    "no device with an active {} port (found: {found:?})",
                    link_layer_name(like.link_layer)
                )
            },
        )
    }

    fn close(&mut self) -> VResult<()> {
        let ctx = self.ctx("ibv_close_device")?;
        self.ctx = ptr::null_mut();
        // SAFETY: ctx came from ibv_open_device and is not used again.
        rc("ibv_close_device", unsafe { ffi::ibv_close_device(ctx) })
    }

    fn alloc_pd(&mut self) -> VResult<Handle> {
        let ctx = self.ctx("ibv_alloc_pd")?;
        // SAFETY: ctx is open.
        Ok(non_null("ibv_alloc_pd", unsafe { ffi::ibv_alloc_pd(ctx) })? as Handle)
    }

    fn dealloc_pd(&mut self, pd: Handle) -> VResult<()> {
        // SAFETY: pd came from alloc_pd.
        rc("ibv_dealloc_pd", unsafe {
            ffi::ibv_dealloc_pd(pd as *mut ffi::ibv_pd)
        })
    }

    fn reg_mr(&mut self, pd: Handle, addr: u64, len: usize, access: u32) -> VResult<MrKeys> {
        // SAFETY: the caller owns `len` bytes at `addr` for as long as the MR exists.
        let mr = non_null("ibv_reg_mr", unsafe {
            ffi::ibv_reg_mr(
                pd as *mut ffi::ibv_pd,
                addr as *mut std::ffi::c_void,
                len,
                access as c_int,
            )
        })?;
        // SAFETY: mr is valid.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok(MrKeys {
            handle: mr as Handle,
            lkey,
            rkey,
        })
    }

    fn dereg_mr(&mut self, mr: Handle) -> VResult<()> {
        // SAFETY: mr came from reg_mr.
        rc("ibv_dereg_mr", unsafe {
            ffi::ibv_dereg_mr(mr as *mut ffi::ibv_mr)
        })
    }

    fn create_cq(&mut self, cqe: u32) -> VResult<Handle> {
        let ctx = self.ctx("ibv_create_cq")?;
        // SAFETY: ctx is open; no completion channel.
        let cq =
            unsafe { ffi::ibv_create_cq(ctx, cqe as c_int, ptr::null_mut(), ptr::null_mut(), 0) };
        Ok(non_null("ibv_create_cq", cq)? as Handle)
    }

    fn destroy_cq(&mut self, cq: Handle) -> VResult<()> {
        // SAFETY: cq came from create_cq.
        rc("ibv_destroy_cq", unsafe {
            ffi::ibv_destroy_cq(cq as *mut ffi::ibv_cq)
        })
    }

    fn create_qp(
        &mut self,
        pd: Handle,
        send_cq: Handle,
        recv_cq: Handle,
        caps: QpCaps,
    ) -> VResult<(Handle, u32)> {
        let mut attr = ffi::ibv_qp_init_attr {
            send_cq: send_cq as *mut ffi::ibv_cq,
            recv_cq: recv_cq as *mut ffi::ibv_cq,
            cap: ffi::ibv_qp_cap {
                max_send_wr: caps.max_send_wr,
                max_recv_wr: caps.max_recv_wr,
                max_send_sge: caps.max_sge,
                max_recv_sge: caps.max_sge,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
            ..Default::default()
        };
        // SAFETY: pd and the CQs are live objects of this context.
        let qp = non_null("ibv_create_qp", unsafe {
            ffi::ibv_create_qp(pd as *mut ffi::ibv_pd, &mut attr)
        })?;
        // Receives may be posted from INIT on, before the QP is connected.
        use ffi::ibv_qp_attr_mask as M;
        let init = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: PORT,
            qp_access_flags: (ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
                | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
                | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ)
                .0,
            ..Default::default()
        };
        let mask = M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS;
        if let Err(e) = modify_qp(qp, "ibv_modify_qp(INIT)", init, mask) {
            // SAFETY: qp is valid and not used after.
            unsafe { ffi::ibv_destroy_qp(qp) };
            return Err(e);
        }
        // SAFETY: qp is valid.
        Ok((qp as Handle, unsafe { (*qp).qp_num }))
    }

    fn connect(&mut self, qp: Handle, psn: u32, remote: &Remote) -> VResult<()> {
        use ffi::ibv_qp_attr_mask as M;
        let qp = qp as *mut ffi::ibv_qp;
        let modify = |op, attr, mask| modify_qp(qp, op, attr, mask);
        let global = remote.port.gid != [0u8; 16];
        let ah = ffi::ibv_ah_attr {
            grh: ffi::ibv_global_route {
                dgid: ffi::ibv_gid {
                    raw: remote.port.gid,
                },
                flow_label: 0,
                sgid_index: self.gid_index,
                hop_limit: 0xff,
                traffic_class: 0,
            },
            dlid: remote.port.lid,
            sl: 0,
            src_path_bits: 0,
            static_rate: 0,
            is_global: global as u8,
            port_num: PORT,
        };
        modify(
            "ibv_modify_qp(RTR)",
            ffi::ibv_qp_attr {
                qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
                path_mtu: self.mtu,
                dest_qp_num: remote.qpn,
                rq_psn: remote.psn,
                max_dest_rd_atomic: 1,
                min_rnr_timer: 12,
                ah_attr: ah,
                ..Default::default()
            },
            M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER,
        )?;
        // rnr_retry 7 retries for ever: after a rebuild a peer may send before the receives
        // are reposted here.
        modify(
            "ibv_modify_qp(RTS)",
            ffi::ibv_qp_attr {
                qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
                timeout: 14,
                retry_cnt: 7,
                rnr_retry: 7,
                sq_psn: psn,
                max_rd_atomic: 1,
                ..Default::default()
            },
            M::IBV_QP_STATE
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_MAX_QP_RD_ATOMIC,
        )
    }

    fn destroy_qp(&mut self, qp: Handle) -> VResult<()> {
        // SAFETY: qp came from create_qp.
        rc("ibv_destroy_qp", unsafe {
            ffi::ibv_destroy_qp(qp as *mut ffi::ibv_qp)
        })
    }

    fn post_send(&mut self, qp: Handle, wr: &SendWr) -> VResult<()> {
        let ctx = self.ctx("ibv_post_send")?;
        let sg = sg_list(&mut self.sgs, &wr.sges);
        let mut w = ffi::ibv_send_wr {
            wr_id: wr.wr_id,
            next: ptr::null_mut(),
            sg_list: sg.as_mut_ptr(),
            num_sge: sg.len() as c_int,
            opcode: match wr.op {
                SendOp::Send => ffi::ibv_wr_opcode::IBV_WR_SEND,
                SendOp::Write { .. } => ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            },
            send_flags: if wr.signaled {
                ffi::ibv_send_flags::IBV_SEND_SIGNALED.0
            } else {
                0
            },
            ..Default::default()
        };
        if let SendOp::Write { remote_addr, rkey } = wr.op {
            w.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr, rkey };
        }
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: the operation table of an open context; qp belongs to it; sg outlives the call.
        let r = unsafe {
            let f = (*ctx)
                .ops
                .post_send
                .ok_or_else(|| err("ibv_post_send", "no provider op"))?;
            f(qp as *mut ffi::ibv_qp, &mut w, &mut bad)
        };
        rc("ibv_post_send", r)
    }

    fn post_recv(&mut self, qp: Handle, wr: &RecvWr) -> VResult<()> {
        let ctx = self.ctx("ibv_post_recv")?;
        let sg = sg_list(&mut self.sgs, &wr.sges);
        let mut w = ffi::ibv_recv_wr {
            wr_id: wr.wr_id,
            next: ptr::null_mut(),
            sg_list: sg.as_mut_ptr(),
            num_sge: sg.len() as c_int,
        };
        let mut bad: *mut ffi::ibv_recv_wr = ptr::null_mut();
        // SAFETY: as in post_send.
        let r = unsafe {
            let f = (*ctx)
                .ops
                .post_recv
                .ok_or_else(|| err("ibv_post_recv", "no provider op"))?;
            f(qp as *mut ffi::ibv_qp, &mut w, &mut bad)
        };
        rc("ibv_post_recv", r)
    }

    fn poll_cq(&mut self, cq: Handle, max: usize) -> VResult<Vec<Completion>> {
        let ctx = self.ctx("ibv_poll_cq")?;
        let max = max.clamp(1, POLL_MAX);
        let wcs = &mut self.wcs;
        // SAFETY: the operation table of an open context; cq belongs to it; wcs has `max` slots.
        let n = unsafe {
            let f = (*ctx)
                .ops
                .poll_cq
                .ok_or_else(|| err("ibv_poll_cq", "no provider op"))?;
            f(cq as *mut ffi::ibv_cq, max as c_int, wcs.as_mut_ptr())
        };
        if n < 0 {
            return Err(err("ibv_poll_cq", format!("error {n}")));
        }
        Ok(wcs[..n as usize]
            .iter()
            .map(|wc| Completion {
                wr_id: wc.wr_id(),
                opcode: if wc.opcode() & ffi::ibv_wc_opcode::IBV_WC_RECV != 0 {
                    Opcode::Recv
                } else {
                    Opcode::Send
                },
                status: wc.error().map(|(s, _)| s).unwrap_or(0),
                byte_len: wc.len() as u32,
                qpn: wc.qp_num,
            })
            .collect())
    }
}
