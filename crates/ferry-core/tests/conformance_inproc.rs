//! The conformance suite on in-process engines with several native
//! capability combinations, raw and behind the adapter (which exercises the
//! adapter's emulation of everything the engine lacks).

use ferry_core::conformance::InprocFactory;
use ferry_core::{Capabilities, Operation};

fn only(op: Operation) -> Capabilities {
    let mut c = Capabilities::default();
    c.set(op, true);
    c
}

/// Nothing optional is native.
mod none {
    use super::*;
    ferry_core::conformance_tests!(InprocFactory::new(Capabilities::default()));
}

/// Everything optional is native.
mod all {
    use super::*;
    ferry_core::conformance_tests!(InprocFactory::new(Capabilities::all()));
}

/// Everything native, but batches of at most 100 requests.
mod all_max_batch_100 {
    use super::*;
    ferry_core::conformance_tests!(InprocFactory::new({
        let mut caps = Capabilities::all();
        caps.max_batch_len = Some(100);
        caps
    }));
}

/// Async batches and notifications, without a synchronous batch or wait.
mod async_notify {
    use super::*;
    ferry_core::conformance_tests!(InprocFactory::new({
        let mut caps = Capabilities::default();
        caps.async_batch = true;
        caps.notify = true;
        caps
    }));
}

mod only_batch_register {
    use super::*;
    ferry_core::conformance_tests!(InprocFactory::new(only(Operation::BatchRegister)));
}

mod only_batch_unregister {
    use super::*;
    ferry_core::conformance_tests!(InprocFactory::new(only(Operation::BatchUnregister)));
}

mod only_batch_transfer {
    use super::*;
    ferry_core::conformance_tests!(InprocFactory::new(only(Operation::BatchTransfer)));
}

mod only_async_batch {
    use super::*;
    ferry_core::conformance_tests!(InprocFactory::new(only(Operation::AsyncBatch)));
}

mod only_batch_wait {
    use super::*;
    ferry_core::conformance_tests!(InprocFactory::new(only(Operation::BatchWait)));
}

mod only_notify {
    use super::*;
    ferry_core::conformance_tests!(InprocFactory::new(only(Operation::Notify)));
}

/// Nothing native, and transfers that pause after every 64 KiB: transfers
/// stay in flight long enough for `unregister_in_flight` to catch an engine
/// (or adapter) that lets `unregister` return early, even on a busy machine.
mod none_paced {
    use super::*;
    ferry_core::conformance_tests!(
        InprocFactory::new(Capabilities::default()).paced(std::time::Duration::from_micros(200))
    );
}

/// Everything native, paced as above.
mod all_paced {
    use super::*;
    ferry_core::conformance_tests!(
        InprocFactory::new(Capabilities::all()).paced(std::time::Duration::from_micros(200))
    );
}
