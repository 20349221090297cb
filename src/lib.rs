//! zhihui: the backend of an AI text-to-image cloud platform. See `ARCHITECTURE.md` for the map.
//!
//! The crate is built in floors, and its modules only ever import from their own floor or one
//! below: the edges (`http`, `web`, `cli`, `startup`, and `state`, the services they share) use
//! the features (`identity`, `tasks`, `dispatch`, `labels`, `points`, `webhooks`), which use the
//! foundations (`platform`), which use the pure domain (`zhihui-domain`).

pub mod platform;

pub mod dispatch;
pub mod gallery;
pub mod identity;
pub mod labels;
pub mod points;
pub mod tasks;
pub mod webhooks;

pub mod cli;
pub mod http;
pub mod startup;
pub mod state;
pub mod web;

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};
    use std::path::Path;

    /// The floor of each room of `src/`: 0 the foundations, 1 the features, 2 the edges.
    fn floor_of(room: &str) -> Option<u8> {
        match room {
            "platform" => Some(0),
            "dispatch" | "gallery" | "identity" | "labels" | "points" | "tasks" | "webhooks" => {
                Some(1)
            }
            "cli" | "http" | "startup" | "state" | "web" => Some(2),
            _ => None,
        }
    }

    /// Every `.rs` file under `dir`, with its module path (`["tasks", "queue", "lease"]`).
    fn modules(dir: &Path, path: &[String], found: &mut Vec<(Vec<String>, String)>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .expect("src/ is readable")
            .map(|entry| entry.expect("a directory entry").path())
            .collect();
        entries.sort();
        for entry in entries {
            let name = entry
                .file_stem()
                .and_then(|name| name.to_str())
                .expect("a UTF-8 file name")
                .to_owned();
            if entry.is_dir() {
                let mut inner = path.to_vec();
                inner.push(name);
                modules(&entry, &inner, found);
            } else if entry.extension().is_some_and(|extension| extension == "rs") {
                let mut module = path.to_vec();
                if name != "mod" && name != "lib" && name != "main" {
                    module.push(name);
                }
                let text = std::fs::read_to_string(&entry).expect("a source file is readable");
                found.push((module, text));
            }
        }
    }

    /// The module paths a file names through `crate::`, outside comments, cut to `depth`.
    fn references(text: &str, depth: usize) -> BTreeSet<Vec<String>> {
        let mut named = BTreeSet::new();
        for line in text.lines() {
            let code = line.split("//").next().unwrap_or("");
            for part in code.split("crate::").skip(1) {
                let path: Vec<String> = part
                    .split("::")
                    .map(|segment| {
                        segment
                            .chars()
                            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                            .collect::<String>()
                    })
                    .take_while(|segment| {
                        segment
                            .chars()
                            .next()
                            .is_some_and(|c| c.is_ascii_lowercase())
                    })
                    .take(depth)
                    .collect();
                if !path.is_empty() {
                    named.insert(path);
                }
            }
        }
        named
    }

    /// A circle in `graph`, if there is one (depth-first search).
    fn circle(graph: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Option<Vec<Vec<String>>> {
        fn visit(
            node: &Vec<String>,
            graph: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
            done: &mut BTreeSet<Vec<String>>,
            trail: &mut Vec<Vec<String>>,
        ) -> Option<Vec<Vec<String>>> {
            if let Some(start) = trail.iter().position(|seen| seen == node) {
                return Some(trail[start..].to_vec());
            }
            if !done.insert(node.clone()) {
                return None;
            }
            trail.push(node.clone());
            for next in graph.get(node).into_iter().flatten() {
                if let Some(found) = visit(next, graph, done, trail) {
                    return Some(found);
                }
            }
            trail.pop();
            None
        }
        let mut done = BTreeSet::new();
        graph
            .keys()
            .find_map(|node| visit(node, graph, &mut done, &mut Vec::new()))
    }

    #[test]
    fn floors_point_down_and_rooms_form_no_circle() {
        let mut files = Vec::new();
        modules(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
            &[],
            &mut files,
        );
        assert!(files.len() > 50, "the walk found the sources");
        let mut upward = Vec::new();
        for (module, text) in &files {
            let Some(room) = module.first() else { continue };
            let Some(floor) = floor_of(room) else {
                panic!("src/{room} is on no floor: name it in floor_of")
            };
            for named in references(text, 1) {
                let Some(target) = floor_of(&named[0]) else {
                    panic!("crate::{} is on no floor: name it in floor_of", named[0])
                };
                if target > floor {
                    upward.push(format!("{} -> {}", module.join("::"), named[0]));
                }
            }
        }
        assert!(
            upward.is_empty(),
            "imports that point up a floor: {upward:#?}"
        );
        // Rooms (src/<room>) and the rooms within them (src/<room>/<room>) import each other
        // one way only: `super::` stays inside a room, so `crate::` paths tell every arrow.
        for depth in [1, 2] {
            let mut graph: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
            for (module, text) in &files {
                let from: Vec<String> = module.iter().take(depth).cloned().collect();
                for to in references(text, depth) {
                    if !from.is_empty() && !to.starts_with(&from) && !from.starts_with(&to) {
                        graph.entry(from.clone()).or_default().insert(to);
                    }
                }
            }
            assert!(
                circle(&graph).is_none(),
                "rooms that import each other round a circle: {:?}",
                circle(&graph)
            );
        }
    }
}
