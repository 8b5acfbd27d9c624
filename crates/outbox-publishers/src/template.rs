//! Target templates: `events.{destination}`, `{event_type}`, `{partition_key}`, `{key}`.

use outbox_core::Event;

/// A parsed template. Unknown placeholders are rejected when the configuration loads.
#[derive(Clone, Debug, PartialEq)]
pub struct Template {
    parts: Vec<Part>,
}

#[derive(Clone, Debug, PartialEq)]
enum Part {
    Text(String),
    Destination,
    EventType,
    PartitionKey,
    OrderingKey,
}

impl Template {
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut parts = Vec::new();
        let mut rest = text;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                parts.push(Part::Text(rest[..open].to_string()));
            }
            let close = rest[open..]
                .find('}')
                .ok_or_else(|| format!("template {text:?} has an unclosed '{{'"))?
                + open;
            parts.push(match &rest[open + 1..close] {
                "destination" => Part::Destination,
                "event_type" => Part::EventType,
                "partition_key" => Part::PartitionKey,
                "key" => Part::OrderingKey,
                other => {
                    return Err(format!(
                        "template {text:?} uses {{{other}}}: use {{destination}}, {{event_type}}, {{partition_key}} or {{key}}"
                    ))
                }
            });
            rest = &rest[close + 1..];
        }
        if !rest.is_empty() {
            parts.push(Part::Text(rest.to_string()));
        }
        Ok(Template { parts })
    }

    /// The text itself when the template has no placeholder (it names one target).
    pub fn literal(&self) -> Option<&str> {
        match self.parts.as_slice() {
            [Part::Text(text)] => Some(text),
            _ => None,
        }
    }

    /// The text before the first placeholder (all of it when there is none).
    pub fn leading_text(&self) -> &str {
        match self.parts.first() {
            Some(Part::Text(text)) => text,
            _ => "",
        }
    }

    /// The identity template: the destination itself.
    pub fn destination() -> Self {
        Template {
            parts: vec![Part::Destination],
        }
    }

    /// Renders the template; `escape` transforms each substituted value (URL encoding for
    /// webhooks), never the literal text.
    pub fn render_with(&self, event: &Event, escape: impl Fn(&str) -> String) -> String {
        let mut out = String::new();
        for part in &self.parts {
            match part {
                Part::Text(t) => out.push_str(t),
                value => out.push_str(&escape(value.text(event))),
            }
        }
        out
    }

    /// Renders the template as written. One allocation: it runs for every event routed.
    pub fn render(&self, event: &Event) -> String {
        let length = self.parts.iter().map(|p| p.text(event).len()).sum();
        let mut out = String::with_capacity(length);
        self.parts.iter().for_each(|p| out.push_str(p.text(event)));
        out
    }
}

impl Part {
    /// The literal text, or the event's value this placeholder stands for.
    fn text<'a>(&'a self, event: &'a Event) -> &'a str {
        match self {
            Part::Text(t) => t,
            Part::Destination => &event.destination,
            Part::EventType => &event.event_type,
            Part::PartitionKey => event.partition_key.as_deref().unwrap_or(""),
            Part::OrderingKey => event.ordering_key(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::Payload;

    fn event() -> Event {
        Event {
            partition_key: Some("c/1".into()),
            ..Event::new(1, uuid::Uuid::nil(), "orders", "created", Payload::Null)
        }
    }

    #[test]
    fn renders_every_placeholder() {
        let t = Template::parse("events.{destination}.{event_type}.{partition_key}.{key}").unwrap();
        assert_eq!(t.render(&event()), "events.orders.created.c/1.c/1");
        let t = Template::parse("https://h/{partition_key}").unwrap();
        assert_eq!(
            t.render_with(&event(), |v| v.replace('/', "%2F")),
            "https://h/c%2F1"
        );
    }

    #[test]
    fn rejects_unknown_or_broken_placeholders() {
        assert!(Template::parse("{topic}")
            .unwrap_err()
            .contains("use {destination}"));
        assert!(Template::parse("a.{destination")
            .unwrap_err()
            .contains("unclosed"));
    }
}
