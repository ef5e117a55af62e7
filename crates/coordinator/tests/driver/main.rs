//! The coordinator against in-process fake agents (`cluster`): the phase driver (`phases`),
//! where restarts put parts (`placement`), partner copies (`copies`), checkpoints ckptd takes
//! by itself (`policy`) and per-user limits (`limits`). One test program: each would otherwise
//! compile the gRPC stack and the fakes again.
mod cluster;
mod copies;
mod limits;
mod lost;
mod phases;
mod placement;
mod policy;
mod spares;
