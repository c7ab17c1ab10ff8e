//! A run as a graph to draw: which node comes after which. A steps node leads to its first
//! group, each group to the next; a DAG node leads to its tasks without dependencies, and
//! each task to those that depend on it; any other node (a loop, a step with an exit hook)
//! leads to its children.

use std::collections::BTreeSet;

use super::{Kind, NodeId, Run};
use crate::depends::Depends;
use crate::workflow::Body;

impl Run {
    /// Every edge `(before, after)` between the run's nodes, each once, in node order.
    pub fn edges(&self) -> Vec<(NodeId, NodeId)> {
        let mut out: Vec<(NodeId, NodeId)> = Vec::new();
        for n in &self.nodes {
            match &n.kind {
                Kind::Steps { children, .. } => {
                    let mut before = vec![n.id];
                    for group in children {
                        for &c in group {
                            out.extend(before.iter().map(|&b| (b, c)));
                        }
                        if !group.is_empty() {
                            before = group.clone();
                        }
                    }
                }
                Kind::Dag { tasks } => {
                    let defs = match self.wf.template(&n.template).map(|t| &t.body) {
                        Some(Body::Dag(defs)) => defs.as_slice(),
                        _ => &[],
                    };
                    for (task, &child) in tasks {
                        let depends = defs
                            .iter()
                            .find(|d| &d.name.text == task)
                            .and_then(|d| d.depends.as_ref())
                            .and_then(|d| Depends::parse(&d.text).ok());
                        let from: Vec<NodeId> = depends
                            .iter()
                            .flat_map(|d| d.tasks())
                            .filter_map(|t| tasks.get(t).copied())
                            .collect();
                        if from.is_empty() {
                            out.push((n.id, child));
                        }
                        out.extend(from.into_iter().map(|f| (f, child)));
                    }
                }
                Kind::Container | Kind::Loop => {}
            }
        }
        // What no rule placed hangs from its parent (loop items, exit hooks).
        let placed: BTreeSet<NodeId> = out.iter().map(|&(_, a)| a).collect();
        for n in &self.nodes {
            if let Some(p) = n.parent
                && !placed.contains(&n.id)
            {
                out.push((p, n.id));
            }
        }
        let mut seen = BTreeSet::new();
        out.retain(|e| seen.insert(*e));
        out
    }
}
