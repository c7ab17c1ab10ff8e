//! What the stand-in binaries share: the toy trainer's gang rendezvous (std only, so the
//! binaries still link statically into `FROM scratch` images).

pub mod rendezvous;
