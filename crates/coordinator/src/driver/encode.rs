//! Erasure-coded redundancy (`[redundancy] scheme = "xor:G"` or `"rs:K+M"`): after commit, in
//! the background and in the partner copies' turn, a job's nodes are split into groups
//! (`ckpt_store::erasure::groups`, across `[redundancy] domains`), every member of a group is
//! let read the others' images, and each computes the parity of the rows it holds
//! (`Agent.Encode`). The epoch records each group's encoding once all its parity is held; a
//! restore of a lost member's part rebuilds it from the group ([`Coordinator::group_for`]).
use ckpt_proto::v1 as pb;
use ckpt_store::erasure::{self, Candidate, EncodedMember, Encoding, ParityShard, Scheme};
use futures_util::future::join_all;
use tracing::{info, warn};

use super::Coordinator;
use crate::model::Epoch;

impl Coordinator {
    /// The erasure-coded scheme a just-committed epoch gets, if any: one is configured and the
    /// job has more nodes than parity shards per row.
    pub(crate) fn plans_encoding(&self, e: &Epoch) -> Option<Scheme> {
        let s = self.scheme_of(e.job_id)?;
        s.code()?;
        (e.nodes.len() > s.parity()).then_some(s)
    }

    /// Why a just-committed epoch gets no parity though its job's scheme is an erasure code:
    /// the job has no more nodes than the scheme's parity shards per row, so there is nowhere
    /// to put parity apart from the images it protects. None when it gets parity, or when the
    /// scheme is not an erasure code.
    pub(crate) fn parity_skipped(&self, e: &Epoch) -> Option<String> {
        let s = self.scheme_of(e.job_id)?;
        s.code()?;
        (e.nodes.len() <= s.parity()).then(|| {
            format!(
                "no parity: {s} needs more nodes than its {} parity shard(s) per row, and this job has {}; until the epoch is in shared storage, losing a node loses its part of it (run such a job with --redundancy partner)",
                s.parity(),
                e.nodes.len()
            )
        })
    }

    /// Encodes every group of the epoch's nodes, in parallel; returns the groups whose parity
    /// is complete (a failed group is logged and left unprotected by parity).
    pub(super) async fn encode_groups(&self, e: &Epoch, scheme: Scheme) -> Vec<Encoding> {
        let mut nodes = e.nodes.clone();
        nodes.sort();
        let candidates: Vec<Candidate> = nodes
            .iter()
            .map(|n| Candidate {
                node: n.clone(),
                domain: self.cfg.redundancy.domains.get(n).cloned(),
            })
            .collect();
        let groups = match erasure::groups(scheme, &candidates) {
            Ok(g) => g,
            Err(why) => {
                warn!(job = e.job_id, epoch = e.number, %scheme, why, "not encoded");
                return Vec::new();
            }
        };
        let done: Vec<Encoding> = join_all(groups.iter().map(|g| self.encode_group(e, scheme, g)))
            .await
            .into_iter()
            .flatten()
            .collect();
        info!(
            job = e.job_id,
            epoch = e.number,
            %scheme,
            groups = groups.len(),
            encoded = done.len(),
            "parity encoded"
        );
        done
    }

    /// Lets `grantee` read, on `holder`, the copy of `node`'s images of the epoch kept there
    /// (with `parity`: the parity `holder` holds) for as long as `ttl`; false (logged) if
    /// `holder`'s agent cannot be asked.
    pub(super) async fn grant_read(
        &self,
        e: &Epoch,
        holder: &str,
        node: &str,
        grantee: &str,
        parity: bool,
        ttl: std::time::Duration,
    ) -> bool {
        let req = pb::AllowFetchRequest {
            job_id: e.job_id,
            epoch: e.number,
            node: node.into(),
            grantee: grantee.into(),
            manifest_digest: if parity {
                String::new()
            } else {
                e.manifests.get(node).cloned().unwrap_or_default()
            },
            ttl_ms: ttl.as_millis() as u64,
            parity,
        };
        match self
            .agents
            .call(
                holder,
                "allow-read",
                self.cfg.deadlines.sync,
                |mut c| async move { c.allow_fetch(req).await },
            )
            .await
        {
            Ok(_) => true,
            Err(f) => {
                warn!(job = e.job_id, epoch = e.number, %holder, %node, %grantee, parity, error = %f,
                    "cannot let a node read a copy kept there; it is left out");
                false
            }
        }
    }

    /// One group: grants, then every member encodes the rows it holds.
    async fn encode_group(&self, e: &Epoch, scheme: Scheme, names: &[String]) -> Option<Encoding> {
        let ttl = self.cfg.deadlines.finalize;
        let members: Vec<pb::GroupMember> = names
            .iter()
            .map(|n| pb::GroupMember {
                node: n.clone(),
                address: self.agents.address(n).unwrap_or_default(),
                manifest_digest: e.manifests.get(n).cloned().unwrap_or_default(),
            })
            .collect();
        let grants = names.iter().flat_map(|a| {
            names
                .iter()
                .filter(move |b| *b != a)
                .map(move |b| self.grant_read(e, a, a, b, false, ttl))
        });
        if !join_all(grants).await.into_iter().all(|ok| ok) {
            return None;
        }
        let calls = names.iter().map(|n| {
            let req = pb::EncodeRequest {
                job_id: e.job_id,
                epoch: e.number,
                scheme: scheme.to_string(),
                members: members.clone(),
            };
            async move {
                let r = self
                    .agents
                    .call(n, "encode", ttl, |mut c| async move { c.encode(req).await })
                    .await;
                (n.clone(), r)
            }
        });
        let mut replies = Vec::new();
        for (n, r) in join_all(calls).await {
            match r {
                Ok(reply) => replies.push(reply),
                Err(f) => {
                    warn!(job = e.job_id, epoch = e.number, node = %n, error = %f, "encoding failed; the group is not protected by parity");
                    return None;
                }
            }
        }
        match encoding_of(scheme, &members, &replies) {
            Ok(enc) => Some(enc),
            Err(why) => {
                warn!(
                    job = e.job_id,
                    epoch = e.number,
                    why,
                    "the group's encoding is not consistent; not recorded"
                );
                None
            }
        }
    }

    /// For a restore of `source`'s part on `to`: the encoding record of its group (JSON) and
    /// where the members are, after letting `to` read the others' images and parity. None when
    /// the epoch has no parity of `source`'s images.
    pub(super) async fn group_for(
        &self,
        e: &Epoch,
        source: &str,
        to: &str,
    ) -> Option<(String, Vec<pb::GroupMember>)> {
        let enc = e.encoding_of(source)?;
        let ttl = self.cfg.deadlines.restore;
        let others: Vec<&EncodedMember> = enc
            .members
            .iter()
            .filter(|m| m.node != source && m.node != to)
            .collect();
        let grants = others.iter().flat_map(|m| {
            [
                self.grant_read(e, &m.node, &m.node, to, false, ttl),
                self.grant_read(e, &m.node, &m.node, to, true, ttl),
            ]
        });
        // A member that cannot be asked is down: the rebuild leaves it out.
        join_all(grants).await;
        let json = serde_json::to_string(enc).ok()?;
        let group = enc
            .members
            .iter()
            .map(|m| pb::GroupMember {
                node: m.node.clone(),
                address: self.agents.address(&m.node).unwrap_or_default(),
                manifest_digest: m.manifest_digest.clone(),
            })
            .collect();
        Some((json, group))
    }
}

/// The record of a group from its members' answers, checked: every member read the same
/// lengths, and the shards are exactly those the layout has.
fn encoding_of(
    scheme: Scheme,
    members: &[pb::GroupMember],
    replies: &[pb::EncodeReply],
) -> Result<Encoding, String> {
    let first = replies.first().ok_or("no member answered")?;
    if replies
        .iter()
        .any(|r| r.stream_lens != first.stream_lens || r.manifest_lens != first.manifest_lens)
        || first.stream_lens.len() != members.len()
        || first.manifest_lens.len() != members.len()
    {
        return Err("members read different lengths of the group's images".into());
    }
    let enc = Encoding {
        scheme: scheme.to_string(),
        members: members
            .iter()
            .enumerate()
            .map(|(i, m)| EncodedMember {
                node: m.node.clone(),
                stream_len: first.stream_lens[i],
                manifest_len: first.manifest_lens[i],
                manifest_digest: m.manifest_digest.clone(),
            })
            .collect(),
        parity: replies
            .iter()
            .enumerate()
            .flat_map(|(holder, r)| {
                r.shards.iter().map(move |s| ParityShard {
                    row: s.row as usize,
                    index: s.index as usize,
                    holder,
                    size: s.size,
                    digest: s.digest.clone(),
                })
            })
            .collect(),
    };
    enc.layout()?;
    let want = members.len() * scheme.parity();
    if enc.parity.len() != want {
        return Err(format!(
            "{} parity shards of the {want} the group has",
            enc.parity.len()
        ));
    }
    Ok(enc)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(n: &str) -> pb::GroupMember {
        pb::GroupMember {
            node: n.into(),
            address: String::new(),
            manifest_digest: format!("d-{n}"),
        }
    }

    fn reply(holder: usize, n: usize, lens: &[u64]) -> pb::EncodeReply {
        let layout = erasure::Layout::new(1, lens).unwrap();
        pb::EncodeReply {
            shards: (0..n)
                .filter(|&r| layout.holders(r)[0] == holder)
                .map(|r| pb::ParityShardInfo {
                    row: r as u32,
                    index: 0,
                    size: layout.row_size(r),
                    digest: "x".into(),
                })
                .collect(),
            stream_lens: lens.to_vec(),
            manifest_lens: vec![10; n],
            elapsed_us: 0,
        }
    }

    #[test]
    fn a_groups_record_needs_every_shard_and_the_same_lengths_from_every_member() {
        let members: Vec<_> = ["a", "b", "c"].map(member).into();
        let lens = [1000, 2000, 3000];
        let scheme = Scheme::Xor { group: 3 };
        let replies: Vec<_> = (0..3).map(|h| reply(h, 3, &lens)).collect();
        let enc = encoding_of(scheme, &members, &replies).unwrap();
        assert_eq!(enc.parity.len(), 3);
        assert_eq!(enc.members[1].stream_len, 2000);
        assert_eq!(enc.members[2].manifest_digest, "d-c");

        let mut short = replies.clone();
        short[2].shards.clear();
        assert!(encoding_of(scheme, &members, &short)
            .unwrap_err()
            .contains("2 parity shards of the 3"));
        let mut other = replies.clone();
        other[1].stream_lens[0] = 999;
        assert!(encoding_of(scheme, &members, &other)
            .unwrap_err()
            .contains("different lengths"));
        let mut wrong = replies;
        wrong[0].shards[0].size += 64;
        assert!(encoding_of(scheme, &members, &wrong)
            .unwrap_err()
            .contains("does not fit"));
    }
}
