//! `ckptctl run --rdma`: the MPI and UCX settings under which Open MPI and MPICH run over
//! InfiniBand/RoCE verbs through the verbs layer the agents preload. docs/infiniband.md gives
//! the reason for each.

use std::collections::HashMap;

/// Setting, value: set in the job's environment unless the job set it.
pub const SETTINGS: &[(&str, &str)] = &[
    // Open MPI: the UCX PML, also on devices that are not Mellanox ones.
    ("OMPI_MCA_pml", "ucx"),
    ("OMPI_MCA_pml_ucx_devices", "any"),
    ("OMPI_MCA_pml_ucx_tls", "any"),
    // Open MPI: no second verbs user (openib, libfabric's verbs provider), no UCX one-sided.
    ("OMPI_MCA_btl", "^openib,ofi"),
    ("OMPI_MCA_mtl", "^ofi"),
    ("OMPI_MCA_osc", "^ucx"),
    // UCX (Open MPI and MPICH): verbs between nodes (rc_verbs wires up over ud_verbs), shared
    // memory between ranks of a node (posix, sysv, cma: the snapshot holds them all).
    ("UCX_TLS", "rc_verbs,ud_verbs,sm,self"),
    // A restart on other nodes changes GIDs; rxe also fails UCX's check.
    ("UCX_UD_VERBS_ETH_DGID_CHECK", "n"),
    // No RDMA connection manager: nothing rebuilds its connections.
    ("UCX_MODULES", "^rdmacm"),
];

/// What `--rdma` did to a job's environment.
#[derive(Debug, Default)]
pub struct Applied {
    /// The settings it added (the job had not set them).
    pub set: Vec<(String, String)>,
    /// Every setting with the value the job runs with, for its parts on other nodes: they
    /// start with a login environment, and Open MPI does not export UCX's variables itself.
    pub part_env: HashMap<String, String>,
}

/// Adds [`SETTINGS`] to `env` where the job has not set them.
pub fn apply(env: &mut HashMap<String, String>) -> Applied {
    let mut a = Applied::default();
    for (k, v) in SETTINGS {
        let have = env.entry(k.to_string()).or_insert_with(|| {
            a.set.push((k.to_string(), v.to_string()));
            v.to_string()
        });
        a.part_env.insert(k.to_string(), have.clone());
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rdma_settings_fill_in_what_the_job_did_not_set_and_go_to_the_other_nodes() {
        let mut env = HashMap::from([("UCX_TLS".to_string(), "rc_verbs,self".to_string())]);
        let a = apply(&mut env);
        assert_eq!(env["UCX_TLS"], "rc_verbs,self", "the job's choice wins");
        assert!(!a.set.iter().any(|(k, _)| k == "UCX_TLS"));
        assert_eq!(a.set.len(), SETTINGS.len() - 1);
        assert_eq!(env["OMPI_MCA_pml"], "ucx");
        assert_eq!(env["UCX_MODULES"], "^rdmacm");
        assert_eq!(
            a.part_env.len(),
            SETTINGS.len(),
            "every setting goes to the other nodes"
        );
        assert_eq!(
            a.part_env["UCX_TLS"], "rc_verbs,self",
            "with the job's value"
        );
        assert_eq!(a.part_env["UCX_MODULES"], "^rdmacm");
    }
}
