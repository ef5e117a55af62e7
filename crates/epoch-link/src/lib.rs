//! How the nodes of a checkpoint epoch are driven through its phases, shared by the coordinator
//! (which drives every node, or every relay) and by a relay agent (which drives the nodes the
//! coordinator delegated to it): one [`link::EpochLink`] per node or subtree, the
//! [`link::barrier`] that gathers a phase's answers within its deadline, the
//! [`relay::Relay`] that stands for a subtree, and the [`failure::NodeFailure`] that names
//! the node that failed.
pub mod failure;
pub mod link;
pub mod relay;
