//! The control channel between a coordinator and its workers: the messages
//! ([`proto`]), the coordinator's side of the connections ([`inbox`],
//! [`outbox`]), and a host's relay ([`relay`], its wire in [`frame`]).

pub mod frame;
pub mod hostwindow;
pub mod inbox;
pub mod outbox;
pub mod proto;
pub mod relay;
