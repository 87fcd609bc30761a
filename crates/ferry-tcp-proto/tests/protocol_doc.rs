//! PROTOCOL.md (in ferry-tcp) names the states of the cores as the code
//! has them (issue 42, item 7): every variant of the target's `Step`,
//! `UnregisterStep`, `Unfinished` and `Delivered` appears in its section
//! 3.1 (with `SameHost` and `Take`), every variant of the initiator's `Frame`, `Then`, `OpState`,
//! `Reply`, `Expect`, `Recv` and `FenceState` in its section 3.2, every variant of the
//! handshake's `InitiatorState`, `TargetState`, `Instr` and `Failure` in
//! its section 3.3. The matches below are exhaustive, so a new variant does not
//! compile here until it is named in the list, and the list is checked
//! against the text.

use ferry_tcp_proto::batch::{Frame, Part, Then};
use ferry_tcp_proto::grants::{Unfinished, UnregisterStep};
use ferry_tcp_proto::handshake::{Failure, InitiatorState, Instr, TargetState, Transport};
use ferry_tcp_proto::initiator::{Expect, FenceState, OpState, Recv, Reply};
use ferry_tcp_proto::target::{Copy, Delivered, SameHost, Step, Take};

fn step_name(s: &Step<()>) -> &'static str {
    match s {
        Step::Done => "Done",
        Step::ReadBuf { .. } => "ReadBuf",
        Step::Receive { .. } => "Receive",
        Step::Send { .. } => "Send",
        Step::Table { .. } => "Table",
        Step::Close(_) => "Close",
        Step::Prove { .. } => "Prove",
        Step::Copy(_) => "Copy",
        Step::Staged(_) => "Staged",
    }
}

fn same_host_name(s: &SameHost) -> &'static str {
    match s {
        SameHost::Unoffered => "Unoffered",
        SameHost::Proving => "Proving",
        SameHost::Refused => "Refused",
        SameHost::Agreed { .. } => "Agreed",
    }
}

fn take_name(t: &Take) -> &'static str {
    match t {
        Take::NotOffered => "NotOffered",
        Take::NotAgreed => "NotAgreed",
        Take::Fd(_) => "Fd",
    }
}

fn unregister_name(s: &UnregisterStep) -> &'static str {
    match s {
        UnregisterStep::Revoke { .. } => "Revoke",
        UnregisterStep::Settle { .. } => "Settle",
        UnregisterStep::Remove => "Remove",
        UnregisterStep::Forget { .. } => "Forget",
        UnregisterStep::Done(_) => "Done",
    }
}

fn unfinished_name(u: &Unfinished) -> &'static str {
    match u {
        Unfinished::Marked { .. } => "Marked",
        Unfinished::Table => "Table",
    }
}

fn delivered_name(d: &Delivered) -> &'static str {
    match d {
        Delivered::Queued => "Queued",
        Delivered::Invalid => "Invalid",
        Delivered::Full => "Full",
    }
}

fn frame_name(f: &Frame<()>) -> &'static str {
    match f {
        Frame::Write(_) => "Write",
        Frame::Read(_) => "Read",
        Frame::WriteV(_) => "WriteV",
        Frame::ReadV(_) => "ReadV",
    }
}

fn then_name(t: &Then) -> &'static str {
    match t {
        Then::Retry(_) => "Retry",
        Then::Notify => "Notify",
        Then::Finish => "Finish",
    }
}

fn op_state_name(s: &OpState) -> &'static str {
    match s {
        OpState::InFlight => "InFlight",
        OpState::Abandoned => "Abandoned",
    }
}

fn reply_name(r: &Reply<()>) -> &'static str {
    match r {
        Reply::Op(_) => "Op",
        Reply::Skip => "Skip",
        Reply::Unknown => "Unknown",
    }
}

fn expect_name(e: &Expect) -> &'static str {
    match e {
        Expect::Ack => "Ack",
        Expect::AckV => "AckV",
        Expect::Data(_) => "Data",
        Expect::DataV => "DataV",
        Expect::Table => "Table",
    }
}

fn fence_name(f: &FenceState) -> &'static str {
    match f {
        FenceState::Holding => "Holding",
        FenceState::Unproven => "Unproven",
        FenceState::Released => "Released",
    }
}

fn recv_name(r: &Recv<()>) -> &'static str {
    match r {
        Recv::Ack(_) => "Ack",
        Recv::Refused(..) => "Refused",
        Recv::Into(..) => "Into",
        Recv::Indices { .. } => "Indices",
        Recv::Refusals { .. } => "Refusals",
        Recv::Acks(_) => "Acks",
        Recv::Table(..) => "Table",
        Recv::Lane => "Lane",
        Recv::Discard(_) => "Discard",
        Recv::Fail(..) => "Fail",
    }
}

/// The text of PROTOCOL.md's section `heading`, up to the next section
/// (`None` when the file is not beside this crate: a packaged copy).
fn section(heading: &str) -> Option<String> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../ferry-tcp/PROTOCOL.md");
    let Ok(text) = std::fs::read_to_string(path) else {
        eprintln!("skipped: {path} is not beside this crate (a packaged copy)");
        return None;
    };
    let start = text.find(heading).expect("the section");
    let end = text[start + heading.len()..]
        .find("\n## ")
        .map_or(text.len(), |e| start + heading.len() + e);
    Some(text[start..end].to_owned())
}

#[test]
fn protocol_md_names_every_state_of_the_initiator_core() {
    let Some(section) = section("## 3.2 The initiator's side as the code has it") else {
        return;
    };
    let part = Part {
        index: 0,
        hold: (),
        off: 0,
        len: 1,
        remote: 0,
        gen: 1,
    };
    let frames = [
        Frame::Write(part.clone()),
        Frame::Read(part.clone()),
        Frame::WriteV(vec![part.clone()]),
        Frame::ReadV(vec![part]),
    ];
    let thens = [Then::Retry(Vec::new()), Then::Notify, Then::Finish];
    let states = [OpState::InFlight, OpState::Abandoned];
    let replies = [Reply::Op(()), Reply::Skip, Reply::Unknown];
    let expects = [
        Expect::Ack,
        Expect::AckV,
        Expect::Data(1),
        Expect::DataV,
        Expect::Table,
    ];
    let recvs = [
        Recv::Ack(()),
        Recv::Refused((), ferry_tcp_proto::frame::Status::StaleRegion, 0, 0),
        Recv::Into((), 1),
        Recv::Indices {
            op: (),
            failed: 1,
            len: 1,
            status: None,
        },
        Recv::Refusals {
            op: (),
            status: ferry_tcp_proto::frame::Status::CopyFailed,
            count: 1,
        },
        Recv::Acks(1),
        Recv::Table((), 24),
        Recv::Lane,
        Recv::Discard(1),
        Recv::Fail(None, String::new()),
    ];
    let fences = [
        FenceState::Holding,
        FenceState::Unproven,
        FenceState::Released,
    ];
    let names = frames
        .iter()
        .map(frame_name)
        .chain(thens.iter().map(then_name))
        .chain(states.iter().map(op_state_name))
        .chain(replies.iter().map(reply_name))
        .chain(expects.iter().map(expect_name))
        .chain(recvs.iter().map(recv_name))
        .chain(fences.iter().map(fence_name));
    for name in names {
        assert!(
            section.contains(&format!("`{name}`")),
            "PROTOCOL.md section 3.2 does not name `{name}`"
        );
    }
}

#[test]
fn protocol_md_names_every_state_of_the_target_core() {
    let Some(section) = section("## 3.1 The target's side as the code has it") else {
        return;
    };
    let copy = || Copy {
        id: 1,
        read: true,
        segs: Vec::new(),
        holds: Vec::new(),
        one_call: true,
    };
    let steps: Vec<Step<()>> = vec![
        Step::Done,
        Step::ReadBuf {
            len: 0,
            ends_frame: true,
        },
        Step::Receive {
            parts: Vec::new(),
            one_call: true,
            landed: (0, 0),
        },
        Step::Send {
            meta: Vec::new(),
            holds: Vec::new(),
            landed: (0, 0),
        },
        Step::Table {
            meta: Vec::new(),
            id: 1,
        },
        Step::Close(String::new()),
        Step::Prove {
            id: 0,
            channel: Take::NotOffered,
            stage: Take::Fd(3),
            grants: false,
        },
        Step::Copy(copy()),
        Step::Staged(copy()),
    ];
    let same_host = [
        SameHost::Unoffered,
        SameHost::Proving,
        SameHost::Refused,
        SameHost::Agreed { staging: true },
    ];
    let takes = [Take::NotOffered, Take::NotAgreed, Take::Fd(3)];
    let unregister = [
        UnregisterStep::Revoke { gen: 1 },
        UnregisterStep::Settle {
            deadline: ferry_tcp_proto::time::Time::ZERO,
        },
        UnregisterStep::Remove,
        UnregisterStep::Forget { gen: 1 },
        UnregisterStep::Done(Ok(())),
    ];
    let unfinished = [
        Unfinished::Marked {
            pid: 1,
            patience: std::time::Duration::ZERO,
        },
        Unfinished::Table,
    ];
    let delivered = [Delivered::Queued, Delivered::Invalid, Delivered::Full];
    let names = steps
        .iter()
        .map(step_name)
        .chain(unregister.iter().map(unregister_name))
        .chain(unfinished.iter().map(unfinished_name))
        .chain(delivered.iter().map(delivered_name))
        .chain(same_host.iter().map(same_host_name))
        .chain(takes.iter().map(take_name));
    for name in names {
        assert!(
            section.contains(&format!("`{name}`"))
                || section.contains(&format!("`Unfinished::{name}`")),
            "PROTOCOL.md section 3.1 does not name `{name}`"
        );
    }
}

fn initiator_state_name(s: InitiatorState) -> &'static str {
    use InitiatorState as S;
    match s {
        S::SendHello => "SendHello",
        S::AwaitFirst => "AwaitFirst",
        S::ReadHello => "ReadHello",
        S::ReadName => "ReadName",
        S::ReadExtLen => "ReadExtLen",
        S::ReadExt => "ReadExt",
        S::SendExt => "SendExt",
        S::Tls => "Tls",
        S::SendProof => "SendProof",
        S::AwaitWelcome => "AwaitWelcome",
        S::ReadProof => "ReadProof",
        S::ReadTableHead => "ReadTableHead",
        S::ReadTable => "ReadTable",
        S::ReadReject => "ReadReject",
        S::ReadRejectMsg => "ReadRejectMsg",
        S::Refusing => "Refusing",
        S::Done => "Done",
        S::Failed => "Failed",
    }
}

fn target_state_name(s: TargetState) -> &'static str {
    use TargetState as S;
    match s {
        S::ReadHello => "ReadHello",
        S::ReadName => "ReadName",
        S::BindCred => "BindCred",
        S::SendHello => "SendHello",
        S::ReadExtLen => "ReadExtLen",
        S::ReadExt => "ReadExt",
        S::Tls => "Tls",
        S::ReadProof => "ReadProof",
        S::Refusing => "Refusing",
        S::Done => "Done",
        S::Failed => "Failed",
    }
}

fn instr_name(i: &Instr<()>) -> &'static str {
    match i {
        Instr::Write { .. } => "Write",
        Instr::Read { .. } => "Read",
        Instr::Tls { .. } => "Tls",
        Instr::BindCred => "BindCred",
        Instr::Done(_) => "Done",
        Instr::Fail(_) => "Fail",
    }
}

fn failure_name(f: &Failure) -> &'static str {
    match f {
        Failure::Transport { .. } => "Transport",
        Failure::NotFerry(_) => "NotFerry",
        Failure::Foreign { .. } => "Foreign",
        Failure::Rejected { .. } => "Rejected",
        Failure::Protocol { .. } => "Protocol",
        Failure::Authentication { .. } => "Authentication",
    }
}

#[test]
fn protocol_md_names_every_state_of_the_handshake_cores() {
    let Some(section) = section("## 3.3 The handshake as the code has it") else {
        return;
    };
    use InitiatorState as I;
    use TargetState as T;
    let initiator = [
        I::SendHello,
        I::AwaitFirst,
        I::ReadHello,
        I::ReadName,
        I::ReadExtLen,
        I::ReadExt,
        I::SendExt,
        I::Tls,
        I::SendProof,
        I::AwaitWelcome,
        I::ReadProof,
        I::ReadTableHead,
        I::ReadTable,
        I::ReadReject,
        I::ReadRejectMsg,
        I::Refusing,
        I::Done,
        I::Failed,
    ];
    let target = [
        T::ReadHello,
        T::ReadName,
        T::BindCred,
        T::SendHello,
        T::ReadExtLen,
        T::ReadExt,
        T::Tls,
        T::ReadProof,
        T::Refusing,
        T::Done,
        T::Failed,
    ];
    let instrs: [Instr<()>; 6] = [
        Instr::Write {
            bytes: Vec::new(),
            what: "",
            best_effort: false,
        },
        Instr::Read {
            len: 0,
            what: "",
            best_effort: false,
        },
        Instr::Tls { client: true },
        Instr::BindCred,
        Instr::Done(()),
        Instr::Fail(Failure::NotFerry(String::new())),
    ];
    let failures = [
        Failure::Transport {
            what: "",
            kind: Transport::Closed,
            unanswered: false,
        },
        Failure::NotFerry(String::new()),
        Failure::Foreign {
            reason: String::new(),
            recognised: false,
        },
        Failure::Rejected {
            status: None,
            reason: String::new(),
        },
        Failure::Protocol {
            peer: String::new(),
            reason: String::new(),
        },
        Failure::Authentication {
            peer: String::new(),
            reason: String::new(),
        },
    ];
    let names = initiator
        .into_iter()
        .map(initiator_state_name)
        .chain(target.into_iter().map(target_state_name))
        .chain(instrs.iter().map(instr_name))
        .chain(failures.iter().map(failure_name));
    for name in names {
        assert!(
            section.contains(&format!("`{name}`")),
            "PROTOCOL.md section 3.3 does not name `{name}`"
        );
    }
    // The state tables name each state in a row of their own side.
    let (ini, tgt) = section.split_at(section.find("Target (`TargetState`)").expect("tables"));
    for s in initiator {
        let n = initiator_state_name(s);
        assert!(
            ini.contains(&format!("| `{n}`")) || ini.contains(&format!(", `{n}`")),
            "initiator table lacks `{n}`"
        );
    }
    for s in target {
        let n = target_state_name(s);
        assert!(
            tgt.contains(&format!("| `{n}`")) || tgt.contains(&format!(", `{n}`")),
            "target table lacks `{n}`"
        );
    }
}
