//! The same-host offer (PROTOCOL.md §5): what an initiator announces in
//! its SAME_HOST request, and the codes of a target's refusal. The checks
//! of an offer against the system (`/proc`, pidfds, `process_vm_readv`)
//! are the driver's (ferry-tcp's `same_host::cma`).

/// Length of the boot id field of a SAME_HOST request.
pub const BOOT_ID_LEN: usize = 48;
/// Length of a SAME_HOST request's payload: boot id, PID namespace inode
/// u64, PID u64, probe address u64, probe nonce (16 bytes).
pub const OFFER_LEN: usize = BOOT_ID_LEN + 8 + 8 + 8 + 16;

/// What an initiator announces in its SAME_HOST request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Offer {
    /// `/proc/sys/kernel/random/boot_id`, ASCII, zero-padded.
    pub boot_id: [u8; BOOT_ID_LEN],
    /// Inode of `/proc/self/ns/pid`.
    pub pidns: u64,
    /// The initiator's PID.
    pub pid: u64,
    /// Address of the probe word in the initiator.
    pub probe_addr: u64,
    /// The probe word's contents.
    pub nonce: [u8; 16],
}

impl Offer {
    /// Encodes the payload.
    pub fn encode(&self) -> [u8; OFFER_LEN] {
        let mut out = [0u8; OFFER_LEN];
        out[..BOOT_ID_LEN].copy_from_slice(&self.boot_id);
        let mut o = BOOT_ID_LEN;
        for v in [self.pidns, self.pid, self.probe_addr] {
            out[o..o + 8].copy_from_slice(&v.to_le_bytes());
            o += 8;
        }
        out[o..].copy_from_slice(&self.nonce);
        out
    }

    /// Decodes the payload (any bytes are a valid offer; the target checks
    /// every field against the system).
    pub fn decode(buf: &[u8; OFFER_LEN]) -> Offer {
        let mut boot_id = [0u8; BOOT_ID_LEN];
        boot_id.copy_from_slice(&buf[..BOOT_ID_LEN]);
        let u = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&buf[o..o + 8]);
            u64::from_le_bytes(a)
        };
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&buf[BOOT_ID_LEN + 24..]);
        Offer {
            boot_id,
            pidns: u(BOOT_ID_LEN),
            pid: u(BOOT_ID_LEN + 8),
            probe_addr: u(BOOT_ID_LEN + 16),
            nonce,
        }
    }
}

/// Why a target refused the path (ERR `SameHostRefused`, `a` = code, `b` =
/// errno or 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u64)]
pub enum Refusal {
    /// The target runs with `same_host=off`.
    Disabled = 1,
    /// Boot ids differ: another machine (or kernel).
    OtherHost = 2,
    /// PID namespaces differ.
    OtherPidNamespace = 3,
    /// `process_vm_readv` of the probe failed (errno in `b`).
    ProbeFailed = 4,
    /// The probe read back other bytes than the nonce.
    ProbeMismatch = 5,
    /// The announced PID does not hold this connection's socket (errno in
    /// `b` if the lookup itself failed).
    NotTheOwner = 6,
    /// The target's platform has no cross-memory attach.
    Unsupported = 7,
    /// Refused, with no detail (this build's targets: the reason is in
    /// the target's log, never told to the peer, so that an offer learns
    /// nothing about the process it names).
    Refused = 8,
}

impl Refusal {
    /// Parses a code.
    pub fn from_u64(v: u64) -> Option<Refusal> {
        Some(match v {
            1 => Refusal::Disabled,
            2 => Refusal::OtherHost,
            3 => Refusal::OtherPidNamespace,
            4 => Refusal::ProbeFailed,
            5 => Refusal::ProbeMismatch,
            6 => Refusal::NotTheOwner,
            7 => Refusal::Unsupported,
            8 => Refusal::Refused,
            _ => return None,
        })
    }

    /// The reason, as the capability report shows it; `errno_name` names
    /// the raw errno the refusal carries (the driver knows the platform's
    /// names).
    pub fn describe(code: u64, errno: u64, errno_name: fn(i32) -> String) -> String {
        let e = errno_name(errno as i32);
        match Refusal::from_u64(code) {
            Some(Refusal::Disabled) => "the peer disables it (same_host=off)".to_owned(),
            Some(Refusal::OtherHost) => "peer on another host (boot ids differ)".to_owned(),
            Some(Refusal::OtherPidNamespace) => "peer in another PID namespace".to_owned(),
            Some(Refusal::ProbeFailed) => format!("process_vm_readv: {e}"),
            Some(Refusal::ProbeMismatch) => {
                "process_vm_readv read back other bytes than the probe".to_owned()
            }
            Some(Refusal::NotTheOwner) if errno != 0 => {
                format!("the peer cannot verify that this process holds the connection: {e}")
            }
            Some(Refusal::NotTheOwner) => {
                "the peer found the connection held by another process".to_owned()
            }
            Some(Refusal::Unsupported) => "the peer's platform has no process_vm_*".to_owned(),
            Some(Refusal::Refused) => "refused by the peer; its log says why".to_owned(),
            None => format!("refused by the peer (code {code}, {e})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offers_round_trip_and_reasons_are_named() {
        let mut boot_id = [0u8; BOOT_ID_LEN];
        boot_id[..5].copy_from_slice(b"boot!");
        let offer = Offer {
            boot_id,
            pidns: 4_026_531_836,
            pid: 4242,
            probe_addr: 0x7f00_dead_beef,
            nonce: [9; 16],
        };
        assert_eq!(Offer::decode(&offer.encode()), offer);
        let name = |e: i32| format!("E{e}");
        assert_eq!(
            Refusal::describe(Refusal::ProbeFailed as u64, 1, name),
            "process_vm_readv: E1"
        );
        assert_eq!(
            Refusal::describe(99, 0, name),
            "refused by the peer (code 99, E0)"
        );
        for code in 1..=8 {
            assert_eq!(Refusal::from_u64(code).map(|r| r as u64), Some(code));
        }
        assert_eq!(Refusal::from_u64(0), None);
    }
}
