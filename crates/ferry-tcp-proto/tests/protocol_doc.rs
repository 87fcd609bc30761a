//! PROTOCOL.md (in ferry-tcp) names the states of the target's core as
//! the code has them (issue 42, item 7): every variant of `Step`,
//! `UnregisterStep`, `Unfinished` and `Delivered` appears in its section
//! 3.1. The matches below are exhaustive, so a new variant does not
//! compile here until it is named in the list, and the list is checked
//! against the text.

use ferry_tcp_proto::grants::{Unfinished, UnregisterStep};
use ferry_tcp_proto::target::{Delivered, Step};

fn step_name(s: &Step<()>) -> &'static str {
    match s {
        Step::Done => "Done",
        Step::ReadBuf { .. } => "ReadBuf",
        Step::Receive { .. } => "Receive",
        Step::Send { .. } => "Send",
        Step::Table { .. } => "Table",
        Step::Close(_) => "Close",
        Step::Driver(_) => "Driver",
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

#[test]
fn protocol_md_names_every_state_of_the_target_core() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../ferry-tcp/PROTOCOL.md");
    let Ok(text) = std::fs::read_to_string(path) else {
        eprintln!("skipped: {path} is not beside this crate (a packaged copy)");
        return;
    };
    let start = text
        .find("## 3.1 The target's side as the code has it")
        .expect("the section");
    let end = text[start..]
        .find("\n## 4.")
        .map_or(text.len(), |e| start + e);
    let section = &text[start..end];
    let req = ferry_tcp_proto::frame::Request::Table { id: 1 };
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
        Step::Driver(req),
    ];
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
        .chain(delivered.iter().map(delivered_name));
    for name in names {
        assert!(
            section.contains(&format!("`{name}`"))
                || section.contains(&format!("`Unfinished::{name}`")),
            "PROTOCOL.md section 3.1 does not name `{name}`"
        );
    }
}
