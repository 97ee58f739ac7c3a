//! Hostfiles in DeepSpeed's format and the [`Topology`] they resolve to.
//!
//! A hostfile line is `HOST slots=N [port=P] [user=U]`; `#` starts a comment. Each
//! line is one node; its ranks are consecutive. `--include` / `--exclude` use
//! DeepSpeed's syntax (`host1:0,1@host2`: slots 0 and 1 of host1, all of host2),
//! then `--num-nodes` keeps the first N nodes and `--workers-per-node` the first N
//! slots of each. Ranks are numbered node by node after all filtering.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::ConfigError;

/// The most workers one node takes (`slots=`, `--workers-per-node`): far
/// more than any node's devices or cores, and few enough that a mistyped
/// count is refused rather than made into millions of ranks.
pub const MAX_SLOTS: usize = 1024;

/// The most ranks a job takes (2^20, hundreds of times today's largest
/// clusters): a mistyped node count is refused rather than allocated.
pub const MAX_WORLD: usize = 1 << 20;

/// One hostfile line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostEntry {
    /// Host name or address.
    pub host: String,
    /// Worker slots on it.
    pub slots: usize,
    /// SSH port.
    pub port: Option<u16>,
    /// SSH user.
    pub user: Option<String>,
    /// 1-based line in the hostfile.
    pub line: usize,
}

/// A parsed hostfile.
#[derive(Debug, Clone)]
pub struct Hostfile {
    /// Its path, for messages.
    pub path: PathBuf,
    /// Its hosts in order.
    pub entries: Vec<HostEntry>,
}

impl Hostfile {
    /// Reads and parses a hostfile.
    pub fn read(path: &Path) -> Result<Hostfile, ConfigError> {
        let text = crate::read_config(path)?;
        Hostfile::parse(path, &text)
    }

    /// Parses hostfile text; `path` is only used in messages.
    pub fn parse(path: &Path, text: &str) -> Result<Hostfile, ConfigError> {
        let err = |line: usize, message: String| ConfigError::Hostfile {
            path: path.to_path_buf(),
            line,
            message,
        };
        let mut entries: Vec<HostEntry> = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let ln = i + 1;
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let mut words = line.split_whitespace();
            let host = words.next().unwrap_or_default().to_string();
            if host.contains('=') {
                return Err(err(ln, format!("expected `HOST slots=N`, got `{line}`")));
            }
            let (mut slots, mut port, mut user) = (None, None, None);
            let mut given: Vec<&str> = Vec::new();
            for w in words {
                let (k, v) = w.split_once('=').ok_or_else(|| {
                    err(ln, format!("expected KEY=VALUE after the host, got `{w}`"))
                })?;
                // `a slots=2 slots=3` took the last until the seventieth
                // session: which one was meant is the user's to say.
                if given.contains(&k) {
                    return Err(err(ln, format!("`{k}` is given twice for `{host}`")));
                }
                given.push(k);
                match k {
                    "slots" => {
                        let n: usize = v.parse().map_err(|_| {
                            err(
                                ln,
                                format!("slots must be a positive whole number, got `{v}`"),
                            )
                        })?;
                        if n == 0 {
                            return Err(err(ln, "slots must be at least 1".into()));
                        }
                        if n > MAX_SLOTS {
                            return Err(err(
                                ln,
                                format!("slots={n}: at most {MAX_SLOTS} workers a node"),
                            ));
                        }
                        slots = Some(n);
                    }
                    "port" => {
                        port = Some(v.parse().map_err(|_| err(ln, format!("bad port `{v}`")))?);
                    }
                    "user" if !v.is_empty() => user = Some(v.to_string()),
                    _ => {
                        let hint = crate::error::did_you_mean(k, ["slots", "port", "user"])
                            .map(|s| format!(", did you mean `{s}`?"))
                            .unwrap_or_else(|| " (valid: slots, port, user)".into());
                        return Err(err(ln, format!("unknown key `{k}`{hint}")));
                    }
                }
            }
            let slots = slots.ok_or_else(|| err(ln, format!("`{host}` has no slots=N")))?;
            if let Some(prev) = entries.iter().find(|e| e.host == host) {
                return Err(err(
                    ln,
                    format!(
                        "host `{host}` is listed twice (first on line {})",
                        prev.line
                    ),
                ));
            }
            entries.push(HostEntry {
                host,
                slots,
                port,
                user,
                line: ln,
            });
        }
        if entries.is_empty() {
            return Err(err(1, "the hostfile lists no hosts".into()));
        }
        Ok(Hostfile {
            path: path.to_path_buf(),
            entries,
        })
    }
}

/// A parsed `--include` / `--exclude` value: hosts, each with all or some slots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotFilter(pub Vec<(String, Option<BTreeSet<usize>>)>);

impl SlotFilter {
    /// Parses DeepSpeed's `host1:0,1@host2` syntax.
    pub fn parse(option: &str, s: &str) -> Result<SlotFilter, ConfigError> {
        let err = |m: String| ConfigError::Option {
            option: option.into(),
            message: m,
        };
        let mut out: Vec<(String, Option<BTreeSet<usize>>)> = Vec::new();
        for part in s.split('@') {
            let part = part.trim();
            if part.is_empty() {
                return Err(err(format!(
                    "empty host in `{s}` (syntax: host1:0,1@host2)"
                )));
            }
            let (host, slots) =
                match part.split_once(':') {
                    None => (part.to_string(), None),
                    Some((h, list)) => {
                        let mut set = BTreeSet::new();
                        for x in list.split(',') {
                            set.insert(x.trim().parse::<usize>().map_err(|_| {
                                err(format!("`{x}` in `{part}` is not a slot index"))
                            })?);
                        }
                        (h.to_string(), Some(set))
                    }
                };
            // A host named twice is one host with the union of its slots
            // (DeepSpeed's `parse_resource_filter`); "all slots" absorbs a list.
            match out.iter_mut().find(|(h, _)| *h == host) {
                Some((_, prev)) => {
                    *prev = match (prev.take(), slots) {
                        (Some(mut a), Some(b)) => {
                            a.extend(b);
                            Some(a)
                        }
                        _ => None,
                    }
                }
                None => out.push((host, slots)),
            }
        }
        Ok(SlotFilter(out))
    }
}

/// One node of the job: a host and the slot indices used on it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Node {
    /// Host name or address.
    pub host: String,
    /// Slot (device) indices used; local rank i runs on slot `slots[i]`.
    pub slots: Vec<usize>,
    /// SSH port.
    pub port: Option<u16>,
    /// SSH user.
    pub user: Option<String>,
}

/// Nodes and ranks of a job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Topology {
    /// Nodes in rank order.
    pub nodes: Vec<Node>,
}

/// Where a rank runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// Global rank.
    pub rank: usize,
    /// Index of its node.
    pub node_rank: usize,
    /// Index within the node.
    pub local_rank: usize,
    /// Ranks on its node.
    pub local_world_size: usize,
}

/// Launch options that shape the topology.
#[derive(Debug, Clone, Default)]
pub struct TopologyOptions {
    /// `--hostfile`.
    pub hostfile: Option<PathBuf>,
    /// `--include`.
    pub include: Option<String>,
    /// `--exclude`.
    pub exclude: Option<String>,
    /// `--num-nodes`.
    pub num_nodes: Option<usize>,
    /// `--workers-per-node`.
    pub workers_per_node: Option<usize>,
    /// Slots of the implicit local node when there is no hostfile.
    pub default_local_slots: usize,
}

impl Topology {
    /// Resolves hostfile and options into nodes and slots.
    pub fn resolve(opts: &TopologyOptions) -> Result<Topology, ConfigError> {
        if let Some(w) = opts
            .workers_per_node
            .filter(|w| !(1..=MAX_SLOTS).contains(w))
        {
            return Err(ConfigError::Option {
                option: "--workers-per-node".into(),
                message: format!("must be between 1 and {MAX_SLOTS}, got {w}"),
            });
        }
        let entries = match &opts.hostfile {
            Some(p) => Hostfile::read(p)?.entries,
            None => vec![HostEntry {
                host: "localhost".into(),
                slots: opts.workers_per_node.unwrap_or(opts.default_local_slots),
                port: None,
                user: None,
                line: 0,
            }],
        };
        let mut nodes: Vec<Node> = entries
            .iter()
            .map(|e| Node {
                host: e.host.clone(),
                slots: (0..e.slots).collect(),
                port: e.port,
                user: e.user.clone(),
            })
            .collect();
        if opts.include.is_some() && opts.exclude.is_some() {
            return Err(ConfigError::Option {
                option: "--include/--exclude".into(),
                message: "give one of them, not both".into(),
            });
        }
        if let Some(inc) = &opts.include {
            let f = SlotFilter::parse("--include", inc)?;
            for (host, slots) in &f.0 {
                let node = nodes
                    .iter()
                    .find(|n| &n.host == host)
                    .ok_or_else(|| unknown_host("--include", host, &nodes))?;
                if let Some(s) = slots {
                    check_slots("--include", host, s, node)?;
                }
            }
            // Hostfile order, not the filter's: rank 0, and what --num-nodes
            // keeps, do not depend on how the filter was spelled.
            let wanted = |host: &str| f.0.iter().find(|(h, _)| h == host).map(|(_, s)| s);
            nodes = nodes
                .into_iter()
                .filter_map(|mut n| {
                    let slots = wanted(&n.host)?;
                    if let Some(s) = slots {
                        n.slots.retain(|x| s.contains(x));
                    }
                    Some(n)
                })
                .collect();
        }
        if let Some(exc) = &opts.exclude {
            let f = SlotFilter::parse("--exclude", exc)?;
            for (host, slots) in &f.0 {
                let idx = nodes
                    .iter()
                    .position(|n| &n.host == host)
                    .ok_or_else(|| unknown_host("--exclude", host, &nodes))?;
                match slots {
                    None => {
                        nodes.remove(idx);
                    }
                    Some(s) => {
                        check_slots("--exclude", host, s, &nodes[idx])?;
                        nodes[idx].slots.retain(|x| !s.contains(x));
                        if nodes[idx].slots.is_empty() {
                            nodes.remove(idx);
                        }
                    }
                }
            }
        }
        if let Some(n) = opts.num_nodes {
            if n == 0 || n > nodes.len() {
                return Err(ConfigError::Option {
                    option: "--num-nodes".into(),
                    message: format!("asked for {n} nodes, {} available", nodes.len()),
                });
            }
            nodes.truncate(n);
        }
        if let (Some(w), Some(_)) = (opts.workers_per_node, &opts.hostfile) {
            for n in &mut nodes {
                if w == 0 || w > n.slots.len() {
                    return Err(ConfigError::Option {
                        option: "--workers-per-node".into(),
                        message: format!(
                            "asked for {w} workers, host `{}` has {} slots",
                            n.host,
                            n.slots.len()
                        ),
                    });
                }
                n.slots.truncate(w);
            }
        }
        if nodes.is_empty() {
            return Err(ConfigError::Option {
                option: "--include/--exclude".into(),
                message: "no host is left to run on".into(),
            });
        }
        let world: usize = nodes.iter().map(|n| n.slots.len()).sum();
        if world > MAX_WORLD {
            return Err(ConfigError::Option {
                option: "--hostfile".into(),
                message: format!("{world} workers in all, more than {MAX_WORLD}"),
            });
        }
        Ok(Topology { nodes })
    }

    /// Total ranks.
    pub fn world_size(&self) -> usize {
        self.nodes.iter().map(|n| n.slots.len()).sum()
    }

    /// Every rank's placement, in rank order.
    pub fn placements(&self) -> Vec<Placement> {
        let mut out = Vec::new();
        for (node_rank, n) in self.nodes.iter().enumerate() {
            for local_rank in 0..n.slots.len() {
                out.push(Placement {
                    rank: out.len(),
                    node_rank,
                    local_rank,
                    local_world_size: n.slots.len(),
                });
            }
        }
        out
    }

    /// Node index of every rank.
    pub fn node_of_rank(&self) -> Vec<usize> {
        self.placements().iter().map(|p| p.node_rank).collect()
    }
}

fn unknown_host(option: &str, host: &str, nodes: &[Node]) -> ConfigError {
    let names: Vec<&str> = nodes.iter().map(|n| n.host.as_str()).collect();
    ConfigError::Option {
        option: option.into(),
        message: format!(
            "host `{host}` is not in the hostfile (hosts: {})",
            names.join(", ")
        ),
    }
}

fn check_slots(
    option: &str,
    host: &str,
    s: &BTreeSet<usize>,
    node: &Node,
) -> Result<(), ConfigError> {
    match s.iter().find(|x| !node.slots.contains(x)) {
        Some(bad) => Err(ConfigError::Option {
            option: option.into(),
            message: match node.slots.len() {
                0 => format!("host `{host}` has no slot {bad} (it has no slots)"),
                n => format!("host `{host}` has no slot {bad} (slots 0-{})", n - 1),
            },
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hf(text: &str) -> Result<Hostfile, ConfigError> {
        Hostfile::parse(Path::new("hosts"), text)
    }

    #[test]
    fn parses_deepspeed_hostfiles() {
        let h = hf("# cluster\nworker-1 slots=4\n\nworker-2 slots=2 port=2222 user=ml # gpu box\n")
            .unwrap();
        assert_eq!(h.entries.len(), 2);
        assert_eq!(
            h.entries[1],
            HostEntry {
                host: "worker-2".into(),
                slots: 2,
                port: Some(2222),
                user: Some("ml".into()),
                line: 4
            }
        );
    }

    #[test]
    fn rejects_bad_lines_with_their_number() {
        let e = hf("a slots=2\nb slots=2\na slots=1\n")
            .unwrap_err()
            .to_string();
        assert_eq!(e, "hosts:3: host `a` is listed twice (first on line 1)");
        assert!(hf("a slots=x\n")
            .unwrap_err()
            .to_string()
            .starts_with("hosts:1: slots"));
        assert!(hf("a\n").unwrap_err().to_string().contains("no slots=N"));
        assert_eq!(
            hf("a slots=2 port=22 slots=3\n").unwrap_err().to_string(),
            "hosts:1: `slots` is given twice for `a`"
        );
        assert!(hf("a slot=2\n")
            .unwrap_err()
            .to_string()
            .contains("did you mean `slots`"));
        assert!(hf("# nothing\n").is_err());
        // A count past any node's devices or cores (it was allocated, and
        // slots=99999999999999 aborted zrun).
        assert_eq!(
            hf("a slots=1024\nb slots=1025\n").unwrap_err().to_string(),
            "hosts:2: slots=1025: at most 1024 workers a node"
        );
        assert!(hf("a slots=99999999999999\n").is_err());
        let nodes: String = (0..1024).map(|i| format!("h{i} slots=1024\n")).collect();
        assert_eq!(topo(&nodes, |_| {}).unwrap().world_size(), MAX_WORLD);
        let nodes = format!("{nodes}h1024 slots=1024\n");
        assert!(topo(&nodes, |_| {})
            .unwrap_err()
            .to_string()
            .contains("1049600 workers in all, more than 1048576"));
        let many = topo("a slots=2\n", |o| o.workers_per_node = Some(1025));
        assert!(many
            .unwrap_err()
            .to_string()
            .contains("--workers-per-node: must be between 1 and 1024, got 1025"));
    }

    fn topo(text: &str, f: impl FnOnce(&mut TopologyOptions)) -> Result<Topology, ConfigError> {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("hosts");
        std::fs::write(&p, text).unwrap();
        let mut o = TopologyOptions {
            hostfile: Some(p),
            default_local_slots: 2,
            ..Default::default()
        };
        f(&mut o);
        Topology::resolve(&o)
    }

    #[test]
    fn include_exclude_and_limits() {
        let t = topo("h1 slots=4\nh2 slots=4\nh3 slots=2\n", |o| {
            o.include = Some("h1:0,2@h3".into())
        })
        .unwrap();
        assert_eq!(
            t.nodes.iter().map(|n| n.slots.clone()).collect::<Vec<_>>(),
            vec![vec![0, 2], vec![0, 1]]
        );
        assert_eq!(t.world_size(), 4);
        assert_eq!(t.node_of_rank(), vec![0, 0, 1, 1]);
        let t = topo("h1 slots=4\nh2 slots=4\n", |o| {
            o.exclude = Some("h1:1@h2".into())
        })
        .unwrap();
        assert_eq!(t.nodes.len(), 1);
        assert_eq!(t.nodes[0].slots, vec![0, 2, 3]);
        let t = topo("h1 slots=4\nh2 slots=4\n", |o| {
            o.num_nodes = Some(1);
            o.workers_per_node = Some(2)
        })
        .unwrap();
        assert_eq!(t.world_size(), 2);
        assert!(topo("h1 slots=4\n", |o| o.include = Some("h9".into())).is_err());
        assert!(topo("h1 slots=4\n", |o| o.include = Some("h1:7".into())).is_err());
        assert!(topo("h1 slots=4\n", |o| o.num_nodes = Some(2)).is_err());
        assert!(topo("h1 slots=4\n", |o| o.workers_per_node = Some(5)).is_err());
    }

    /// DeepSpeed's launcher semantics (its `parse_inclusion_exclusion` cases):
    /// a host named twice is one node, filters keep hostfile order, a repeated
    /// exclusion is no error, and slot ranges read as `0-3`.
    #[test]
    fn filters_follow_deepspeed() {
        let hosts = "worker-0 slots=4\nworker-1 slots=4\n";
        let slots = |t: Topology| -> Vec<(String, Vec<usize>)> {
            t.nodes.into_iter().map(|n| (n.host, n.slots)).collect()
        };
        let t = topo(hosts, |o| o.include = Some("worker-0@worker-0".into())).unwrap();
        assert_eq!(slots(t), vec![("worker-0".to_string(), vec![0, 1, 2, 3])]);
        let t = topo(hosts, |o| o.include = Some("worker-0:0@worker-0:2".into())).unwrap();
        assert_eq!(slots(t), vec![("worker-0".to_string(), vec![0, 2])]);
        let t = topo(hosts, |o| o.include = Some("worker-0:1@worker-0".into())).unwrap();
        assert_eq!(slots(t)[0].1, vec![0, 1, 2, 3], "all slots absorb a list");
        // Spelled in reverse, ranks still follow the hostfile.
        let t = topo(hosts, |o| o.include = Some("worker-1@worker-0".into())).unwrap();
        assert_eq!(t.nodes[0].host, "worker-0");
        let t = topo(hosts, |o| {
            o.include = Some("worker-1@worker-0".into());
            o.num_nodes = Some(1)
        })
        .unwrap();
        assert_eq!(t.nodes[0].host, "worker-0");
        let t = topo(hosts, |o| o.exclude = Some("worker-0:1@worker-0:1".into())).unwrap();
        assert_eq!(slots(t)[0].1, vec![0, 2, 3]);
        let t = topo(hosts, |o| o.exclude = Some("worker-1@worker-1".into())).unwrap();
        assert_eq!(t.nodes.len(), 1);
        let e = topo(hosts, |o| o.include = Some("worker-0:4".into()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("has no slot 4 (slots 0-3)"), "{e}");
    }

    #[test]
    fn no_hostfile_means_local_slots() {
        let o = TopologyOptions {
            workers_per_node: Some(3),
            default_local_slots: 2,
            ..Default::default()
        };
        let t = Topology::resolve(&o).unwrap();
        assert_eq!(t.nodes[0].host, "localhost");
        assert_eq!(t.world_size(), 3);
        let p = t.placements();
        assert_eq!((p[2].local_rank, p[2].local_world_size), (2, 3));
    }
}
