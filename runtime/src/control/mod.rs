//! The control channel between a coordinator and its workers: the messages
//! ([`proto`]) and the coordinator's side of the connections ([`inbox`]).

pub mod frame;
pub mod hostwindow;
pub mod inbox;
pub mod outbox;
pub mod proto;
pub mod relay;
